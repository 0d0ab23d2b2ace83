// Runtime: the Backend (readiness and the communication thread), the
// Timeline it records into, and the bucket planner.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bagua/core/timeline.h"
#include "bagua/runtime/backend.h"
#include "bagua/runtime/planner.h"
#include "bindings.h"

namespace bagua::python {
namespace {

void bind_timeline(py::module_& m) {
  py::class_<Timeline, std::shared_ptr<Timeline>>(m, "Timeline")
      .def(py::init<int>(), py::arg("rank"))
      .def("now_us", &Timeline::now_us)
      .def("instant",
           [](Timeline& t, const std::string& name, const std::string& category) {
             t.instant(name, category, Timeline::kTrainingLane);
           })
      .def("span",
           [](Timeline& t, const std::string& name, const std::string& category,
              std::int64_t start_us, std::int64_t end_us) {
             t.span(name, category, Timeline::kTrainingLane, start_us, end_us);
           })
      .def("to_json", &Timeline::to_json)
      .def("__len__", &Timeline::size);
}

// Destroyed with the GIL released: the communication thread may need it to
// finish a python op before it can be joined.
std::shared_ptr<Backend> make_backend(int rank, double timeout_s,
                                      std::shared_ptr<Timeline> timeline) {
  return std::shared_ptr<Backend>(
      new Backend(BackendOptions{
          .rank = rank, .timeout = from_seconds(timeout_s), .timeline = std::move(timeline)}),
      [](Backend* backend) {
        if (PyGILState_Check()) {
          py::gil_scoped_release nogil;
          delete backend;
        } else {
          delete backend;
        }
      });
}

void bind_backend_class(py::module_& m) {
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def(py::init(&make_backend), py::arg("rank"), py::arg("timeout_s") = 0.0,
           py::arg("timeline") = nullptr)
      .def("register_ordered_buckets", &Backend::register_ordered_buckets)
      // cuda_stream: for a CUDA tensor, the producing stream as an integer
      // (torch.cuda.current_stream().cuda_stream; 0 is the default stream).
      .def(
          "mark_communication_ready",
          [](Backend& backend, const std::string& name, std::optional<std::uintptr_t> stream) {
            if (stream) {
              backend.mark_communication_ready_on_stream(name, as_stream(*stream));
            } else {
              backend.mark_communication_ready(name);
            }
          },
          py::arg("name"), py::arg("cuda_stream") = std::nullopt)
      .def("rebind_tensor", &Backend::rebind_tensor, py::arg("name"), py::arg("view"))
      .def("mark_remaining_ready", &Backend::mark_remaining_ready)
      // The tensors not marked ready yet this iteration, in bucket order.
      .def("unready_tensor_names", &Backend::unready_tensor_names)
      .def("wait_pending_comm_ops", &Backend::wait_pending_comm_ops, ReleaseGil())
      .def("last_ready_order", &Backend::last_ready_order)
      .def("stats_json", &Backend::stats_json)
      .def_property_readonly("completed_iterations", &Backend::completed_iterations);
}

using DeclaredTensor = std::tuple<std::string, std::int64_t, std::string, std::string>;

// tensors: (name, numel, dtype, device) in ready order; returns the buckets
// as lists of indices into it.
std::vector<std::vector<std::size_t>> plan(const std::vector<DeclaredTensor>& declared,
                                           std::int64_t bucket_bytes) {
  std::vector<TensorDeclaration> tensors;
  tensors.reserve(declared.size());
  for (const auto& [name, numel, dtype, device] : declared) {
    tensors.push_back({name, numel, parse_dtype(dtype), parse_device(device)});
  }
  return plan_buckets(tensors, bucket_bytes);
}

}  // namespace

void bind_backend(py::module_& m) {
  bind_timeline(m);
  bind_backend_class(m);
  m.def("plan_buckets", &plan, py::arg("tensors"), py::arg("bucket_bytes"));
}

}  // namespace bagua::python
