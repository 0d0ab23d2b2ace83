// Communication: stores (with the bridge to PyTorch's c10d store),
// communicators and their collectives, the hierarchical pair, and the Gloo
// and NCCL factories.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/host_staging.h"
#include "bagua/comm/nccl_communicator.h"
#include "bagua/comm/store.h"
#include "bagua/core/cuda.h"
#include "bagua/core/reduce_op.h"
#include "bindings.h"

namespace bagua::python {
namespace {

using CommPtr = std::shared_ptr<Communicator>;

// Held by every call of every PythonStore into its Python store.
std::mutex& store_calls_mutex() {
  static std::mutex mutex;
  return mutex;
}

// PyTorch's c10d store (or any object with set/get/wait) as a bagua::Store.
class PythonStore final : public Store {
 public:
  explicit PythonStore(py::object store) : store_(gil_safe(std::move(store))) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    call("set", key, [&] { store_->attr("set")(key, py::bytes(value.data(), value.size())); });
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, get_timeout());  // a get of a missing key would block the connection
    std::vector<char> result;
    call("get", key, [&] {
      std::string bytes = py::bytes(store_->attr("get")(key));
      result.assign(bytes.begin(), bytes.end());
    });
    return result;
  }

  // Polls with check() where the store has it, rather than one blocking
  // wait: a c10d client holds its one connection for the whole of a wait,
  // so two threads of one process rendezvousing two groups at once (two
  // wrapped models trained from two threads) would each hold their
  // process's connection while waiting for a key the other thread of the
  // peer could not set: a deadlock across ranks.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const std::string first = keys.empty() ? std::string() : keys.front();
    bool can_check = false;
    call("wait", first, [&] { can_check = py::hasattr(*store_, "check"); });
    if (!can_check) {
      call("wait", first, [&] {
        py::object timedelta = py::module_::import("datetime").attr("timedelta");
        store_->attr("wait")(keys, timedelta(py::arg("milliseconds") = timeout.count()));
      });
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      bool present = false;
      call("wait", first, [&] { present = store_->attr("check")(keys).cast<bool>(); });
      if (present) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw StoreError(
            fmt::format("store wait '{}' failed: not set within {} ms", first, timeout.count()));
      }
      if (PyGILState_Check() != 0) {
        py::gil_scoped_release released;  // a caller holding the GIL must not stall Python
        std::this_thread::sleep_for(pause);
      } else {
        std::this_thread::sleep_for(pause);
      }
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  // The store's own timeout (c10d's `timeout` property), else the runtime's.
  std::chrono::milliseconds get_timeout() {
    std::chrono::milliseconds timeout = std::chrono::seconds(300);
    call("get", "timeout", [&] {
      if (py::hasattr(*store_, "timeout")) {
        timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
            store_->attr("timeout").attr("total_seconds")().cast<double>() * 1000));
      }
    });
    return timeout;
  }

  // One call at a time per process: torch 1.13's TCPStore client is not
  // safe to use from two threads at once (their replies cross). The mutex
  // is taken before the GIL, never while holding it, so a thread waiting
  // for the mutex never blocks the one holding it.
  template <typename Fn>
  void call(const char* what, const std::string& key, Fn&& fn) {
    // One mutex for every call (a static local here would be one per Fn).
    std::unique_lock lock(store_calls_mutex(), std::defer_lock);
    if (PyGILState_Check() != 0) {
      py::gil_scoped_release released;
      lock.lock();
    } else {
      lock.lock();
    }
    py::gil_scoped_acquire gil;
    try {
      fn();
    } catch (py::error_already_set& e) {
      throw StoreError(fmt::format("store {} '{}' failed: {}", what, key, e.what()));
    }
  }

  std::shared_ptr<py::object> store_;
};

void bind_store(py::module_& m) {
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
  m.def("file_store", &make_file_store);
}

// The collectives; the reduce op by name ("sum", "avg", "min", "max", "product").
void bind_collectives(py::class_<Communicator, CommPtr>& c) {
  c.def(
       "allreduce",
       [](Communicator& comm, const TensorView& s, const TensorView& r, const std::string& op) {
         comm.allreduce(s, r, parse_reduce_op(op));
       },
       ReleaseGil())
      .def(
          "reduce",
          [](Communicator& comm, const TensorView& s, const TensorView& r, int root,
             const std::string& op) { comm.reduce(s, r, root, parse_reduce_op(op)); },
          ReleaseGil())
      .def("broadcast", &Communicator::broadcast, ReleaseGil())
      .def("allgather", &Communicator::allgather, ReleaseGil())
      .def("gather", &Communicator::gather, ReleaseGil())
      .def("scatter", &Communicator::scatter, ReleaseGil())
      .def(
          "reduce_scatter",
          [](Communicator& comm, const TensorView& s, const TensorView& r, const std::string& op) {
            comm.reduce_scatter(s, r, parse_reduce_op(op));
          },
          ReleaseGil())
      .def("alltoall", &Communicator::alltoall, ReleaseGil())
      .def("send", &Communicator::send, ReleaseGil())
      .def("recv", &Communicator::recv, ReleaseGil())
      .def("barrier", &Communicator::barrier, ReleaseGil())
      .def(
          "partial_allreduce",
          [](Communicator& comm, const TensorView& s, const TensorView& r,
             const std::vector<int>& members, const std::string& op, std::uint64_t group_id,
             bool verify) {
            comm.partial_allreduce(s, r, members, parse_reduce_op(op), group_id, verify);
          },
          py::arg("send"), py::arg("recv"), py::arg("members"), py::arg("op"), py::arg("group_id"),
          py::arg("verify") = false, ReleaseGil())
      .def(
          "next_partial_id",
          [](Communicator& comm, const std::vector<int>& members) {
            return comm.next_partial_id(members);
          },
          py::arg("members"));
}

void bind_communicator(py::module_& m) {
  py::class_<Communicator, CommPtr> c(m, "Communicator");
  c.def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend_name", &Communicator::backend_name)
      // Whether tensors on this device ("cpu", "cuda", "cuda:1") can be passed
      // as they are: NCCL, and Gloo in a CUDA build (staged through pinned
      // host memory), take CUDA tensors.
      .def(
          "supports",
          [](const Communicator& comm, const std::string& device) {
            return comm.supports(parse_device(device).type);
          },
          py::arg("device"))
      .def("abort", &Communicator::abort)
      .def("verify_same_call", &Communicator::verify_same_call, py::arg("op"), py::arg("tensor"),
           py::arg("root") = -1, py::arg("refusal") = "", ReleaseGil())
      .def(
          "new_group",
          [](Communicator& comm, std::vector<int> ranks) -> CommPtr {
            return comm.new_group(ranks);
          },
          ReleaseGil())
      .def(
          "new_bucket_group",
          [](Communicator& comm, std::vector<int> ranks) -> CommPtr {
            return comm.new_bucket_group(ranks);
          },
          ReleaseGil())
      .def_property_readonly(
          "bytes_sent", [](const Communicator& comm) { return comm.counters().bytes_sent.load(); })
      .def_property_readonly("calls",
                             [](const Communicator& comm) { return comm.counters().calls.load(); });
  bind_collectives(c);
}

CommPtr gloo_communicator(std::shared_ptr<Store> store, int rank, int size,
                          const std::string& prefix, const std::string& interface_name,
                          const std::string& hostname, double timeout_s) {
  GlooOptions options{.prefix = prefix,
                      .interface_name = interface_name,
                      .hostname = hostname,
                      .timeout = from_seconds(timeout_s),
                      .shared_memory = std::nullopt,
                      .network_identity = {}};
  auto comm = make_gloo_communicator(std::move(store), rank, size, std::move(options));
  // With CUDA built in, CUDA buffers reach Gloo through pinned host memory.
  return cuda_compiled() ? CommPtr(with_host_staging(std::move(comm))) : CommPtr(std::move(comm));
}

CommPtr nccl_communicator(std::shared_ptr<Store> store, int rank, int size,
                          const std::string& prefix, int device, double timeout_s) {
  NcclOptions options{.prefix = prefix, .device = device, .timeout = from_seconds(timeout_s)};
  return make_nccl_communicator(std::move(store), rank, size, std::move(options));
}

void bind_factories(py::module_& m) {
  m.def("gloo_communicator", &gloo_communicator, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("prefix") = "bagua", py::arg("interface_name") = "", py::arg("hostname") = "",
        py::arg("timeout_s") = 0.0, ReleaseGil());
  m.def("nccl_unavailable_reason", &nccl_unavailable_reason);
  m.def("nccl_communicator", &nccl_communicator, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("prefix") = "bagua", py::arg("device") = 0, py::arg("timeout_s") = 0.0,
        ReleaseGil());
}

void bind_hierarchy(py::module_& m) {
  py::class_<HierarchicalComms, std::shared_ptr<HierarchicalComms>>(m, "HierarchicalComms")
      .def_readonly("intra", &HierarchicalComms::intra)
      .def_readonly("inter", &HierarchicalComms::inter)
      .def_readonly("local_size", &HierarchicalComms::local_size)
      .def_readonly("nodes", &HierarchicalComms::nodes)
      .def_readonly("largest_node", &HierarchicalComms::largest_node)
      .def_property_readonly("is_leader", &HierarchicalComms::is_leader)
      .def_property_readonly("single_level", &HierarchicalComms::single_level);
  m.def(
      "hierarchical_comms",
      [](Communicator& global, const std::vector<int>& node_of_rank) {
        return std::make_shared<HierarchicalComms>(make_hierarchical_comms(global, node_of_rank));
      },
      ReleaseGil());
}

}  // namespace

void bind_comm(py::module_& m) {
  bind_store(m);
  bind_communicator(m);
  bind_factories(m);
  bind_hierarchy(m);
}

}  // namespace bagua::python
