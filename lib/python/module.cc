// The Python module `bagua_core`: the runtime's types and functions, with
// the GIL released around everything that communicates or waits.
//
// Errors: every bagua::Error subclass maps to a Python exception class that
// derives from both BaguaError and the matching builtin (ValueError,
// TimeoutError, RuntimeError), so callers can catch either.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bagua/bagua.h"
#include "bagua/comm/host_staging.h"
#include "bagua/comm/nccl_communicator.h"
#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/logging.h"
#include "bagua/runtime/cuda_compute.h"

namespace py = pybind11;
using namespace bagua;

namespace {

void require_comm_supports(const Bucket& b, const Communicator& comm, const char* op) {
  BAGUA_CHECK_ARG(comm.supports(b.device().type),
                  "{}: bucket '{}' is on {} but the {} communicator cannot reach that memory "
                  "(use BAGUA_BACKEND=nccl for CUDA tensors)",
                  op, b.name(), b.device().str(), comm.backend_name());
}

// A Python object that may be dropped from any thread: takes the GIL to
// release its reference.
template <typename T = py::object>
std::shared_ptr<T> gil_safe(T object) {
  return std::shared_ptr<T>(new T(std::move(object)), [](T* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// PyTorch's c10d store (or any object with set/get/wait) as a bagua::Store.
class PythonStore final : public Store {
 public:
  explicit PythonStore(py::object store) : store_(gil_safe(std::move(store))) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    call("set", key, [&] { store_->attr("set")(key, py::bytes(value.data(), value.size())); });
  }

  std::vector<char> get(const std::string& key) override {
    std::vector<char> result;
    call("get", key, [&] {
      std::string bytes = py::bytes(store_->attr("get")(key));
      result.assign(bytes.begin(), bytes.end());
    });
    return result;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    call("wait", keys.empty() ? std::string() : keys.front(), [&] {
      py::object timedelta = py::module_::import("datetime").attr("timedelta");
      store_->attr("wait")(keys, timedelta(py::arg("milliseconds") = timeout.count()));
    });
  }

 private:
  template <typename Fn>
  void call(const char* what, const std::string& key, Fn&& fn) {
    py::gil_scoped_acquire gil;
    try {
      fn();
    } catch (py::error_already_set& e) {
      throw StoreError(fmt::format("store {} '{}' failed: {}", what, key, e.what()));
    }
  }

  std::shared_ptr<py::object> store_;
};

// A Python callable run on the communication thread.
std::function<void(const std::string&)> python_callback(py::function fn) {
  auto held = gil_safe(py::object(std::move(fn)));
  return [held](const std::string& bucket_name) {
    py::gil_scoped_acquire gil;
    try {
      (*held)(bucket_name);
    } catch (py::error_already_set& e) {
      throw BackendError(fmt::format("python op raised: {}", e.what()));
    }
  };
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

ReduceOp parse_reduce_op(const std::string& name) {
  for (auto op :
       {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
    if (to_string(op) == name) return op;
  }
  throw InvalidArgument("unsupported reduce op '" + name +
                        "' (supported: sum, avg, min, max, product)");
}

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

py::handle make_exception(py::module_& m, const char* name, py::tuple bases) {
  PyObject* type =
      PyErr_NewException((std::string("bagua_core.") + name).c_str(), bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.attr(name) = py::handle(type);  // the module's reference keeps it alive
  return py::handle(type);
}

}  // namespace

PYBIND11_MODULE(bagua_core, m) {
  m.doc() = "bagua runtime: communicators, buckets, comm ops and the scheduler";

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

  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_device_count", &cuda_device_count);
  // CUDA kernels, for tests and benchmarks on a GPU machine. `stream` is a
  // cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream).
  m.def(
      "cuda_divide_inplace",
      [](const TensorView& x, std::int64_t divisor, std::uintptr_t stream) {
        cuda_divide_inplace(x, divisor, reinterpret_cast<void*>(stream));
      },
      py::arg("x"), py::arg("divisor"), py::arg("stream") = 0);
  m.def(
      "cuda_minmax_uint8_compress",
      [](const TensorView& x, std::int64_t chunk_elements, std::uintptr_t out,
         std::uintptr_t stream) {
        cuda_minmax_uint8_compress(x, chunk_elements, reinterpret_cast<void*>(out),
                                   reinterpret_cast<void*>(stream));
      },
      py::arg("x"), py::arg("chunk_elements"), py::arg("out"), py::arg("stream") = 0);
  m.def(
      "cuda_minmax_uint8_decompress",
      [](std::uintptr_t in, std::int64_t chunk_elements, const TensorView& out, bool accumulate,
         std::uintptr_t stream) {
        cuda_minmax_uint8_decompress(reinterpret_cast<const void*>(in), chunk_elements, out,
                                     accumulate, reinterpret_cast<void*>(stream));
      },
      py::arg("input"), py::arg("chunk_elements"), py::arg("out"), py::arg("accumulate") = false,
      py::arg("stream") = 0);
  m.def(
      "cuda_chunked_reduce",
      [](const TensorView& chunks, std::int64_t chunk_count, const TensorView& out, bool mean,
         std::uintptr_t stream) {
        cuda_chunked_reduce(chunks, chunk_count, out, mean, reinterpret_cast<void*>(stream));
      },
      py::arg("chunks"), py::arg("chunk_count"), py::arg("out"), py::arg("mean"),
      py::arg("stream") = 0);
  m.def(
      "cuda_async_average_update",
      [](const TensorView& w, const TensorView& sum, const TensorView& snapshot, std::int64_t ranks,
         std::uintptr_t stream) {
        cuda_async_average_update(w, sum, snapshot, ranks, reinterpret_cast<void*>(stream));
      },
      py::arg("w"), py::arg("sum"), py::arg("snapshot"), py::arg("ranks"), py::arg("stream") = 0);
  // Pool statistics, to check that steady-state iterations reuse memory and
  // events (device -1: the pinned host staging pool).
  m.def("cuda_event_pool_created", [](int device) { return cuda_event_pool(device).created(); });
  m.def("scratch_pool_stats", [](int device) {
    const CachingAllocatorStats stats =
        (device < 0 ? pinned_host_pool() : cuda_device_pool(device)).stats();
    return py::dict(py::arg("blocks_in_use") = stats.blocks_in_use,
                    py::arg("bytes_in_use") = stats.bytes_in_use,
                    py::arg("blocks_cached") = stats.blocks_cached,
                    py::arg("bytes_cached") = stats.bytes_cached,
                    py::arg("system_allocations") = stats.system_allocations,
                    py::arg("cache_hits") = stats.cache_hits);
  });
  m.def("default_bucket_bytes", [] { return env().default_bucket_bytes; });
  m.def("comm_timeout_s", [] { return static_cast<double>(env().comm_timeout.count()) / 1000.0; });
  m.def("log", [](const std::string& level, const std::string& message) {
    log().log(spdlog::level::from_str(level), "{}", message);
  });

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

  py::class_<Store, std::shared_ptr<Store>>(m, "Store")
      .def("set",
           [](Store& s, const std::string& key, const py::bytes& value) {
             std::string bytes = value;
             s.set(key, std::vector<char>(bytes.begin(), bytes.end()));
           })
      .def("get", [](Store& s, const std::string& key) {
        auto value = s.get(key);
        return py::bytes(value.data(), value.size());
      });
  m.def("python_store", [](py::object store) -> std::shared_ptr<Store> {
    return std::make_shared<PythonStore>(std::move(store));
  });
  m.def("hash_store", &make_hash_store);
  m.def("file_store", &make_file_store);

  using CommPtr = std::shared_ptr<Communicator>;
  const auto release = py::call_guard<py::gil_scoped_release>();
  py::class_<Communicator, CommPtr>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend_name", &Communicator::backend_name)
      .def(
          "allreduce",
          [](Communicator& c, const TensorView& s, const TensorView& r, const std::string& op) {
            c.allreduce(s, r, parse_reduce_op(op));
          },
          release)
      .def(
          "reduce",
          [](Communicator& c, const TensorView& s, const TensorView& r, int root,
             const std::string& op) { c.reduce(s, r, root, parse_reduce_op(op)); },
          release)
      .def("broadcast", &Communicator::broadcast, release)
      .def("allgather", &Communicator::allgather, release)
      .def("gather", &Communicator::gather, release)
      .def("scatter", &Communicator::scatter, release)
      .def(
          "reduce_scatter",
          [](Communicator& c, const TensorView& s, const TensorView& r, const std::string& op) {
            c.reduce_scatter(s, r, parse_reduce_op(op));
          },
          release)
      .def("alltoall", &Communicator::alltoall, release)
      .def("send", &Communicator::send, release)
      .def("recv", &Communicator::recv, release)
      .def("barrier", &Communicator::barrier, release)
      .def("abort", &Communicator::abort)
      .def("verify_same_call", &Communicator::verify_same_call, py::arg("op"), py::arg("tensor"),
           py::arg("root") = -1, release)
      .def(
          "new_group",
          [](Communicator& c, std::vector<int> ranks) -> CommPtr { return c.new_group(ranks); },
          release)
      .def(
          "new_bucket_group",
          [](Communicator& c, std::vector<int> ranks) -> CommPtr {
            return c.new_bucket_group(ranks);
          },
          release)
      .def_property_readonly("bytes_sent",
                             [](const Communicator& c) { return c.counters().bytes_sent.load(); })
      .def_property_readonly("calls",
                             [](const Communicator& c) { return c.counters().calls.load(); });

  m.def(
      "gloo_communicator",
      [](std::shared_ptr<Store> store, int rank, int size, const std::string& prefix,
         const std::string& interface_name, const std::string& hostname,
         double timeout_s) -> CommPtr {
        GlooOptions options{
            .prefix = prefix,
            .interface_name = interface_name,
            .hostname = hostname,
            .timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000))};
        auto comm = make_gloo_communicator(std::move(store), rank, size, std::move(options));
        // With CUDA built in, CUDA buffers reach Gloo through pinned host memory.
        return cuda_compiled() ? CommPtr(with_host_staging(std::move(comm)))
                               : CommPtr(std::move(comm));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("prefix") = "bagua",
      py::arg("interface_name") = "", py::arg("hostname") = "", py::arg("timeout_s") = 0.0,
      release);

  m.def("nccl_unavailable_reason", &nccl_unavailable_reason);
  m.def(
      "nccl_communicator",
      [](std::shared_ptr<Store> store, int rank, int size, const std::string& prefix, int device,
         double timeout_s) -> CommPtr {
        NcclOptions options{
            .prefix = prefix,
            .device = device,
            .timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000))};
        return make_nccl_communicator(std::move(store), rank, size, std::move(options));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("prefix") = "bagua",
      py::arg("device") = 0, py::arg("timeout_s") = 0.0, release);

  py::class_<HierarchicalComms, std::shared_ptr<HierarchicalComms>>(m, "HierarchicalComms")
      .def_readonly("intra", &HierarchicalComms::intra)
      .def_readonly("inter", &HierarchicalComms::inter)
      .def_readonly("local_size", &HierarchicalComms::local_size)
      .def_property_readonly("is_leader", &HierarchicalComms::is_leader);
  m.def(
      "hierarchical_comms",
      [](Communicator& global, const std::vector<int>& node_of_rank) {
        return std::make_shared<HierarchicalComms>(make_hierarchical_comms(global, node_of_rank));
      },
      release);

  py::class_<Bucket, std::shared_ptr<Bucket>>(m, "Bucket")
      .def(py::init([](std::string name,
                       const std::vector<std::pair<std::string, TensorView>>& tensors) {
             std::vector<BucketTensor> list;
             list.reserve(tensors.size());
             for (const auto& [tensor_name, view] : tensors) list.push_back({tensor_name, view});
             return std::make_shared<Bucket>(std::move(name), std::move(list));
           }),
           py::arg("name"), py::arg("tensors"))
      .def_property_readonly("name", &Bucket::name)
      .def_property_readonly("numel", &Bucket::numel)
      .def_property_readonly("is_flat", &Bucket::is_flat)
      .def_property_readonly("op_names",
                             [](const Bucket& b) {
                               std::vector<std::string> names;
                               for (const auto& op : b.ops()) names.emplace_back(op->name());
                               return names;
                             })
      .def("clear_ops", &Bucket::clear_ops)
      .def(
          "append_centralized_synchronous_op",
          [](Bucket& b, CommPtr global, std::shared_ptr<HierarchicalComms> hierarchy,
             bool hierarchical, bool average, bool scattergather) {
            if (global) require_comm_supports(b, *global, "append_centralized_synchronous_op");
            b.append_op(std::make_unique<CentralizedSynchronousOp>(
                std::move(global), std::move(hierarchy),
                CentralizedSynchronousOptions{.hierarchical = hierarchical,
                                              .average = average,
                                              .scattergather = scattergather}));
          },
          py::arg("communicator"), py::arg("hierarchy"), py::arg("hierarchical"),
          py::arg("average"), py::arg("scattergather"))
      .def(
          "append_centralized_low_precision_op",
          [](Bucket& b, CommPtr global, std::shared_ptr<HierarchicalComms> hierarchy,
             bool hierarchical, bool average, bool error_feedback) {
            if (global) require_comm_supports(b, *global, "append_centralized_low_precision_op");
            b.append_op(std::make_unique<CentralizedLowPrecisionOp>(
                std::move(global), std::move(hierarchy), b.dtype(),
                CentralizedLowPrecisionOptions{.hierarchical = hierarchical,
                                               .average = average,
                                               .error_feedback = error_feedback}));
          },
          py::arg("communicator"), py::arg("hierarchy"), py::arg("hierarchical"),
          py::arg("average"), py::arg("error_feedback"))
      .def(
          "append_low_precision_decentralized_op",
          [](Bucket& b, CommPtr global, std::shared_ptr<HierarchicalComms> hierarchy,
             const TensorView& weight, const TensorView& left, const TensorView& right,
             bool hierarchical) {
            if (global) {
              require_comm_supports(b, *global, "append_low_precision_decentralized_op");
            }
            b.append_op(std::make_unique<LowPrecisionDecentralizedOp>(
                std::move(global), std::move(hierarchy), weight, left, right, b.numel(), b.dtype(),
                LowPrecisionDecentralizedOptions{.hierarchical = hierarchical}));
          },
          py::arg("communicator"), py::arg("hierarchy"), py::arg("weight"), py::arg("left"),
          py::arg("right"), py::arg("hierarchical"))
      .def(
          "append_decentralized_synchronous_op",
          [](Bucket& b, CommPtr global, std::shared_ptr<HierarchicalComms> hierarchy,
             const TensorView& peer_weight, bool hierarchical, const std::string& mode) {
            if (global) require_comm_supports(b, *global, "append_decentralized_synchronous_op");
            BAGUA_CHECK_ARG(peer_weight.device == b.device(),
                            "append_decentralized_synchronous_op: peer_weight is on {}, bucket "
                            "'{}' on {}",
                            peer_weight.device.str(), b.name(), b.device().str());
            auto op = std::make_shared<DecentralizedSynchronousOp>(
                std::move(global), std::move(hierarchy), peer_weight, b.numel(), b.dtype(),
                DecentralizedSynchronousOptions{.hierarchical = hierarchical,
                                                .peer_selection = parse_peer_selection(mode)});
            b.append_op(op);
            return op;
          },
          py::arg("communicator"), py::arg("hierarchy"), py::arg("peer_weight"),
          py::arg("hierarchical"), py::arg("peer_selection_mode"))
      .def(
          "append_asynchronous_model_average_op",
          [](Bucket& b, CommPtr dedicated, const std::string& mode, std::int64_t sync_interval_ms) {
            if (dedicated) {
              require_comm_supports(b, *dedicated, "append_asynchronous_model_average_op");
            }
            auto op = std::make_shared<AsyncModelAverageOp>(
                std::move(dedicated), b,
                AsyncModelAverageOptions{
                    .peer_selection = parse_peer_selection(mode),
                    .sync_interval = std::chrono::milliseconds(sync_interval_ms)});
            b.append_op(op);
            return op;
          },
          py::arg("communicator"), py::arg("peer_selection_mode"), py::arg("sync_interval_ms"))
      .def_property_readonly("op_bytes_sent",
                             [](const Bucket& b) {
                               std::vector<std::int64_t> bytes;
                               bytes.reserve(b.ops().size());
                               for (const auto& op : b.ops()) bytes.push_back(op->bytes_sent());
                               return bytes;
                             })
      .def("append_python_op",
           [](Bucket& b, py::function fn) {
             b.append_op(std::make_unique<CallbackOp>(python_callback(std::move(fn))));
           })
      .def(
          "execute_ops",
          [](Bucket& b) {
            for (const auto& op : b.ops()) op->execute(b);
          },
          release);

  py::class_<CommOp, std::shared_ptr<CommOp>>(m, "CommOp")
      .def_property_readonly("name", [](const CommOp& op) { return std::string(op.name()); })
      .def_property_readonly("bytes_sent", &CommOp::bytes_sent);
  py::class_<DecentralizedSynchronousOp, CommOp, std::shared_ptr<DecentralizedSynchronousOp>>(
      m, "DecentralizedSynchronousOp")
      .def("copy_back_peer_weight", &DecentralizedSynchronousOp::copy_back_peer_weight, release)
      .def_property_readonly("communication_step", &DecentralizedSynchronousOp::communication_step);
  py::class_<AsyncModelAverageOp, CommOp, std::shared_ptr<AsyncModelAverageOp>>(
      m, "AsyncModelAverageOp")
      // cuda_stream (CUDA weights): the training stream as an integer, so the
      // background work is ordered after the kernels using the weights.
      .def(
          "lock_weight",
          [](AsyncModelAverageOp& op, std::optional<std::uintptr_t> stream) {
            if (stream) {
              op.lock_weight_on_stream(reinterpret_cast<void*>(*stream));
            } else {
              op.lock_weight();
            }
          },
          py::arg("cuda_stream") = std::nullopt, release)
      .def(
          "unlock_weight",
          [](AsyncModelAverageOp& op, std::optional<std::uintptr_t> stream) {
            if (stream) {
              op.unlock_weight_on_stream(reinterpret_cast<void*>(*stream));
            } else {
              op.unlock_weight();
            }
          },
          py::arg("cuda_stream") = std::nullopt, release)
      .def("abort", &AsyncModelAverageOp::abort, release)
      .def("resume", &AsyncModelAverageOp::resume, release)
      .def("reset", &AsyncModelAverageOp::reset, release)
      .def("get_status",
           [](const AsyncModelAverageOp& op) { return std::string(to_string(op.status())); })
      .def("rethrow_failure", &AsyncModelAverageOp::rethrow_failure)
      .def_property_readonly("completed_rounds", &AsyncModelAverageOp::completed_rounds);
  m.def("shift_one_peer", &shift_one_peer, py::arg("rank"), py::arg("size"), py::arg("step"));

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

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def(py::init([](int rank, double timeout_s, std::shared_ptr<Timeline> timeline) {
             // Destroy with the GIL released: the communication thread may
             // need it to finish a python op before it can be joined.
             return std::shared_ptr<Backend>(
                 new Backend(BackendOptions{.rank = rank,
                                            .timeout = std::chrono::milliseconds(
                                                static_cast<std::int64_t>(timeout_s * 1000)),
                                            .timeline = std::move(timeline)}),
                 [](Backend* backend) {
                   if (PyGILState_Check()) {
                     py::gil_scoped_release nogil;
                     delete backend;
                   } else {
                     delete backend;
                   }
                 });
           }),
           py::arg("rank"), py::arg("timeout_s") = 0.0, py::arg("timeline") = nullptr)
      .def("register_ordered_buckets", &Backend::register_ordered_buckets)
      // cuda_stream: for a CUDA tensor, the producing stream as an integer
      // (torch.cuda.current_stream().cuda_stream; 0 is the default stream).
      .def(
          "mark_communication_ready",
          [](Backend& backend, const std::string& name, std::optional<std::uintptr_t> stream) {
            if (stream) {
              backend.mark_communication_ready_on_stream(name, reinterpret_cast<void*>(*stream));
            } else {
              backend.mark_communication_ready(name);
            }
          },
          py::arg("name"), py::arg("cuda_stream") = std::nullopt)
      .def("mark_remaining_ready", &Backend::mark_remaining_ready)
      .def("wait_pending_comm_ops", &Backend::wait_pending_comm_ops, release)
      .def("last_ready_order", &Backend::last_ready_order)
      .def("stats_json", &Backend::stats_json)
      .def_property_readonly("completed_iterations", &Backend::completed_iterations);

  m.def("minmax_uint8_compressed_bytes",
        [](std::int64_t numel) { return minmax_uint8::compressed_bytes(numel); });
  m.def(
      "minmax_uint8_compress",
      [](const TensorView& input, const TensorView& output) {
        check_compressible(input.dtype, "minmax_uint8_compress");
        BAGUA_CHECK_ARG(output.nbytes() == minmax_uint8::compressed_bytes(input.numel),
                        "minmax_uint8_compress: output has {} bytes, {} needed", output.nbytes(),
                        minmax_uint8::compressed_bytes(input.numel));
        minmax_uint8::compress_view(input, output.bytes());
      },
      release);
  m.def(
      "minmax_uint8_decompress",
      [](const TensorView& input, const TensorView& output, bool accumulate) {
        check_compressible(output.dtype, "minmax_uint8_decompress");
        BAGUA_CHECK_ARG(input.nbytes() == minmax_uint8::compressed_bytes(output.numel),
                        "minmax_uint8_decompress: input has {} bytes, {} expected", input.nbytes(),
                        minmax_uint8::compressed_bytes(output.numel));
        minmax_uint8::decompress_view(input.bytes(), output, accumulate);
      },
      py::arg("input"), py::arg("output"), py::arg("accumulate") = false, release);
  m.def(
      "plan_buckets",
      [](const std::vector<std::tuple<std::string, std::int64_t, std::string, std::string>>&
             declared,
         std::int64_t bucket_bytes) {
        std::vector<TensorDeclaration> tensors;
        tensors.reserve(declared.size());
        for (const auto& [name, numel, dtype, device] : declared) {
          tensors.push_back({name, numel, parse_dtype(dtype), parse_device(device)});
        }
        return plan_buckets(tensors, bucket_bytes);
      },
      py::arg("tensors"), py::arg("bucket_bytes"));
}
