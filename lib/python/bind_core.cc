// Core: the error hierarchy as Python exceptions, TensorView, logging, the
// environment and what the build supports.
//
// Errors: every bagua::Error subclass maps to a Python exception class that
// derives from both BaguaError and the matching builtin (ValueError,
// TimeoutError, RuntimeError), so callers can catch either.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "bindings.h"

namespace bagua::python {
namespace {

// The Python exception classes, created once at import and kept for the life
// of the interpreter (the translator below must be a plain function).
struct ExceptionClasses {
  py::handle base, invalid, timeout, backend, store, internal;
};
ExceptionClasses exception_classes;

// pybind11 requires this exact signature (by value).
void translate_exception(std::exception_ptr p) {  // NOLINT(performance-unnecessary-value-param)
  const auto& c = exception_classes;
  try {
    if (p) std::rethrow_exception(p);
  } catch (const InvalidArgument& e) {
    PyErr_SetString(c.invalid.ptr(), e.what());
  } catch (const TimeoutError& e) {
    PyErr_SetString(c.timeout.ptr(), e.what());
  } catch (const BackendError& e) {
    PyErr_SetString(c.backend.ptr(), e.what());
  } catch (const StoreError& e) {
    PyErr_SetString(c.store.ptr(), e.what());
  } catch (const InternalError& e) {
    PyErr_SetString(c.internal.ptr(), e.what());
  } catch (const Error& e) {
    PyErr_SetString(c.base.ptr(), e.what());
  }
}

py::handle make_exception(py::module_& m, const char* name, const py::tuple& bases) {
  PyObject* type =
      PyErr_NewException((std::string("bagua_core.") + name).c_str(), bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.attr(name) = py::handle(type);  // the module's reference keeps it alive
  return py::handle(type);
}

void bind_exceptions(py::module_& m) {
  auto base = make_exception(m, "BaguaError", py::make_tuple(py::handle(PyExc_RuntimeError)));
  auto invalid =
      make_exception(m, "InvalidArgumentError", py::make_tuple(base, py::handle(PyExc_ValueError)));
  auto timeout =
      make_exception(m, "CommTimeoutError", py::make_tuple(base, py::handle(PyExc_TimeoutError)));
  auto backend = make_exception(m, "BackendError", py::make_tuple(base));
  auto store = make_exception(m, "StoreError", py::make_tuple(base));
  auto internal = make_exception(m, "InternalError", py::make_tuple(base));
  exception_classes = {base, invalid, timeout, backend, store, internal};
  py::register_exception_translator(&translate_exception);
}

void bind_tensor_view(py::module_& m) {
  py::class_<TensorView>(m, "TensorView")
      .def(py::init([](std::uintptr_t data, std::int64_t numel, const std::string& dtype,
                       const std::string& device) {
             BAGUA_CHECK_ARG(numel >= 0, "negative element count {}", numel);
             return TensorView{reinterpret_cast<void*>(data), numel, parse_dtype(dtype),
                               parse_device(device)};
           }),
           py::arg("data_ptr"), py::arg("numel"), py::arg("dtype"), py::arg("device") = "cpu")
      .def_property_readonly("numel", [](const TensorView& v) { return v.numel; })
      .def_property_readonly("dtype",
                             [](const TensorView& v) { return std::string(to_string(v.dtype)); })
      .def_property_readonly(
          "data_ptr", [](const TensorView& v) { return reinterpret_cast<std::uintptr_t>(v.data); })
      .def("__repr__", &TensorView::describe);
}

// Attribute names: the variable's name without BAGUA_, in lower case.
void bind_env(py::module_& m) {
  py::class_<EnvConfig>(m, "EnvConfig",
                        "The BAGUA_* variables, parsed once (include/bagua/core/env.h, "
                        "docs/environment.md); an empty string means unset.")
      .def_readonly("log_level", &EnvConfig::log_level)
      .def_property_readonly(
          "comm_timeout_s",
          [](const EnvConfig& e) { return static_cast<double>(e.comm_timeout.count()) / 1000.0; })
      .def_readonly("default_bucket_size", &EnvConfig::default_bucket_bytes)
      .def_readonly("backend", &EnvConfig::backend)
      .def_readonly("check_collectives", &EnvConfig::check_collectives)
      .def_readonly("shared_memory", &EnvConfig::shared_memory)
      .def_readonly("shared_memory_min_bytes", &EnvConfig::shared_memory_min_bytes)
      .def_readonly("shared_memory_direct", &EnvConfig::shared_memory_direct)
      .def_readonly("gloo_hostname", &EnvConfig::gloo_hostname)
      .def_readonly("timeline", &EnvConfig::timeline)
      .def_readonly("autotune", &EnvConfig::autotune)
      .def_readonly("autotune_plan", &EnvConfig::autotune_plan)
      .def_readonly("check_replicas_every", &EnvConfig::check_replicas_every)
      .def_readonly("host_threads", &EnvConfig::host_threads)
      .def_readonly("low_precision_segment", &EnvConfig::low_precision_segment)
      .def_readonly("algorithm", &EnvConfig::algorithm)
      .def_readonly("autotune_output", &EnvConfig::autotune_output)
      .def_readonly("autotune_warmup_steps", &EnvConfig::autotune_warmup_steps)
      .def_readonly("autotune_window_steps", &EnvConfig::autotune_window_steps)
      .def_readonly("autotune_max_trials", &EnvConfig::autotune_max_trials)
      .def_readonly("autotune_max_seconds", &EnvConfig::autotune_max_seconds);
  // A copy: the Python object does not depend on the cache's lifetime.
  m.def(
      "env", [] { return env(); },
      "The environment's configuration, read at the first call and cached; "
      "InvalidArgumentError names a variable with an invalid value.");
}

}  // namespace

ReduceOp parse_reduce_op(const std::string& name) {
  for (auto op :
       {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
    if (to_string(op) == name) return op;
  }
  throw InvalidArgument("unsupported reduce op '" + name +
                        "' (supported: sum, avg, min, max, product)");
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device{DeviceType::kCPU, -1};
  if (text.rfind("cuda", 0) == 0) {
    const auto colon = text.find(':');
    return Device{DeviceType::kCUDA,
                  colon == std::string::npos ? 0 : std::stoi(text.substr(colon + 1))};
  }
  throw InvalidArgument("unsupported device '" + text + "' (expected cpu or cuda[:index])");
}

void bind_core(py::module_& m) {
  bind_exceptions(m);
  bind_tensor_view(m);
  bind_env(m);
  m.def("log", [](const std::string& level, const std::string& message) {
    log().log(spdlog::level::from_str(level), "{}", message);
  });
  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_device_count", &cuda_device_count);
}

}  // namespace bagua::python
