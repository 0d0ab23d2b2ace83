// The Python module `bagua_core`, one binding unit per layer:
//   bind_core.cc     errors and their exception classes, TensorView,
//                    logging, the environment (env.h), CUDA capability
//   bind_comm.cc     stores (and the bridge to PyTorch's), communicators,
//                    hierarchical pairs, the Gloo and NCCL factories
//   bind_ops.cc      the ops' options, Bucket and its ops, op handles
//   bind_backend.cc  Backend, Timeline, the bucket planner
//   bind_bluefog.cc  the neighbour ops behind bagua.bluefog
//   bind_ripples.cc  Ripples' static schedule, group generator engine and
//                    service, low-precision P-Reduce
//   bind_testing.cc  `bagua_core._testing`: hooks for tests and benchmarks
//                    only (raw kernels, pools, in-process store)
// module.cc only calls them in that order (the exception classes first).
//
// GIL: everything that communicates or waits is bound with ReleaseGil;
// Python objects kept by C++ are held through gil_safe.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "bagua/core/reduce_op.h"
#include "bagua/core/tensor_view.h"

namespace bagua::python {

namespace py = pybind11;

void bind_core(py::module_& m);
void bind_comm(py::module_& m);
void bind_ops(py::module_& m);
void bind_backend(py::module_& m);
void bind_bluefog(py::module_& m);
void bind_ripples(py::module_& m);
void bind_testing(py::module_& testing);

// Releases the GIL for the duration of a bound call.
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

// A Python object that may be dropped from any thread: takes the GIL to
// release its reference.
template <typename T = py::object>
std::shared_ptr<T> gil_safe(T object) {
  return std::shared_ptr<T>(new T(std::move(object)), [](T* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// "cpu", "cuda" or "cuda:<index>" (InvalidArgument otherwise).
Device parse_device(const std::string& text);

// "sum", "avg", "min", "max" or "product" (InvalidArgument otherwise).
ReduceOp parse_reduce_op(const std::string& name);

// A cudaStream_t passed from Python as an integer
// (torch.cuda.current_stream().cuda_stream; 0 is the legacy default stream).
inline void* as_stream(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

// Seconds from Python (0 or less: "inherit the default") as milliseconds.
inline std::chrono::milliseconds from_seconds(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
}

}  // namespace bagua::python
