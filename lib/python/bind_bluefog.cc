// The neighbour ops behind `bagua.bluefog`: NeighborAllreduce and
// NeighborAllgather (include/bagua/ops/neighbor_*.h), each bound to the
// communicator it was made with. Options are keyword-only, as the other ops'.
// And the WindowService of the win_* calls (bagua/runtime/window_service.h):
// weights travel as (rank, weight) pairs; every call that communicates or
// waits releases the GIL.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bagua/ops/neighbor_allgather.h"
#include "bagua/ops/neighbor_allreduce.h"
#include "bagua/runtime/window_service.h"
#include "bindings.h"

namespace bagua::python {
namespace {

using CommPtr = std::shared_ptr<Communicator>;
using Weights = std::vector<std::pair<int, double>>;

std::vector<NeighborWeight> to_weights(const Weights& pairs) {
  std::vector<NeighborWeight> out;
  for (const auto& [rank, weight] : pairs) out.push_back({rank, weight});
  return out;
}

void bind_neighbor_allreduce(py::module_& m) {
  using O = NeighborAllreduceOptions;
  py::class_<O>(m, "NeighborAllreduceOptions")
      .def(py::init([](std::optional<double> self_weight, const Weights& sources,
                       std::vector<int> ignored_sources, const Weights& destinations,
                       bool check_pattern, std::string name) {
             return O{.self_weight = self_weight,
                      .sources = to_weights(sources),
                      .ignored_sources = std::move(ignored_sources),
                      .destinations = to_weights(destinations),
                      .check_pattern = check_pattern,
                      .name = std::move(name)};
           }),
           py::kw_only(), py::arg("self_weight") = std::nullopt, py::arg("sources") = Weights{},
           py::arg("ignored_sources") = std::vector<int>{}, py::arg("destinations") = Weights{},
           py::arg("check_pattern") = true, py::arg("name") = "");
  py::class_<NeighborAllreduce, std::shared_ptr<NeighborAllreduce>>(m, "NeighborAllreduce")
      .def(py::init<CommPtr>(), py::arg("communicator"))
      .def("run", &NeighborAllreduce::run, py::arg("input"), py::arg("output"), py::arg("options"),
           ReleaseGil());
}

void bind_neighbor_allgather(py::module_& m) {
  using O = NeighborAllgatherOptions;
  py::class_<O>(m, "NeighborAllgatherOptions")
      .def(py::init([](std::vector<int> sources, std::vector<int> destinations, bool check_pattern,
                       std::string name) {
             return O{.sources = std::move(sources),
                      .destinations = std::move(destinations),
                      .check_pattern = check_pattern,
                      .name = std::move(name)};
           }),
           py::kw_only(), py::arg("sources") = std::vector<int>{},
           py::arg("destinations") = std::vector<int>{}, py::arg("check_pattern") = true,
           py::arg("name") = "");
  py::class_<NeighborAllgatherPlan>(m, "NeighborAllgatherPlan")
      .def_readonly("counts", &NeighborAllgatherPlan::counts)
      .def_property_readonly("total", &NeighborAllgatherPlan::total);
  py::class_<NeighborAllgather, std::shared_ptr<NeighborAllgather>>(m, "NeighborAllgather")
      .def(py::init<CommPtr>(), py::arg("communicator"))
      .def(
          "plan",
          [](NeighborAllgather& op, const std::string& dtype, std::int64_t numel, O options) {
            return op.plan(parse_dtype(dtype), numel, std::move(options));
          },
          py::arg("dtype"), py::arg("numel"), py::arg("options"), ReleaseGil())
      .def("run", &NeighborAllgather::run, py::arg("plan"), py::arg("input"), py::arg("output"),
           ReleaseGil());
}

std::vector<WindowPeer> to_peers(const Weights& pairs) {
  std::vector<WindowPeer> out;
  for (const auto& [rank, weight] : pairs) out.push_back({rank, weight});
  return out;
}

void bind_window_service(py::module_& m) {
  py::class_<WindowService, std::shared_ptr<WindowService>>(m, "WindowService")
      .def(py::init([](Communicator& comm, std::size_t chunk_bytes) {
             return std::make_shared<WindowService>(
                 comm, WindowServiceOptions{.chunk_bytes = chunk_bytes});
           }),
           py::arg("communicator"), py::kw_only(),
           py::arg("chunk_bytes") = WindowServiceOptions{}.chunk_bytes, ReleaseGil())
      .def("create", &WindowService::create, py::arg("name"), py::arg("tensor"), py::arg("sources"),
           py::arg("zero_init"), py::arg("refusal") = "", ReleaseGil())
      .def("free", &WindowService::free, py::arg("name"), ReleaseGil())
      .def("names", &WindowService::names)
      .def("exists", &WindowService::exists, py::arg("name"))
      .def(
          "put",
          [](WindowService& s, const std::string& name, const TensorView& data,
             const Weights& destinations, double self_weight, bool accumulate, bool require_mutex,
             bool with_p) {
            const auto peers = to_peers(destinations);
            s.put(name, data, peers, self_weight, accumulate, require_mutex, with_p);
          },
          py::arg("name"), py::arg("data"), py::arg("destinations"), py::kw_only(),
          py::arg("self_weight"), py::arg("accumulate"), py::arg("require_mutex"),
          py::arg("with_p"), ReleaseGil())
      .def(
          "get",
          [](WindowService& s, const std::string& name, const Weights& sources, bool require_mutex,
             bool with_p) {
            const auto peers = to_peers(sources);
            s.get(name, peers, require_mutex, with_p);
          },
          py::arg("name"), py::arg("sources"), py::kw_only(), py::arg("require_mutex"),
          py::arg("with_p"), ReleaseGil())
      .def(
          "update",
          [](WindowService& s, const std::string& name, double self_weight,
             const Weights& neighbors, double divisor, bool reset, const TensorView& out,
             bool require_mutex, bool with_p) {
            const auto peers = to_peers(neighbors);
            s.update(name, self_weight, peers, divisor, reset, out, require_mutex, with_p);
          },
          py::arg("name"), py::arg("self_weight"), py::arg("neighbors"), py::kw_only(),
          py::arg("divisor"), py::arg("reset"), py::arg("out"), py::arg("require_mutex"),
          py::arg("with_p"), ReleaseGil())
      .def("versions", &WindowService::versions, py::arg("name"))
      .def("associated_p", &WindowService::associated_p, py::arg("name"))
      .def("lock", &WindowService::lock, py::arg("name"), py::arg("ranks"), ReleaseGil())
      .def("unlock", &WindowService::unlock, py::arg("name"), py::arg("ranks"), ReleaseGil())
      .def_property_readonly("rank", &WindowService::rank)
      .def_property_readonly("size", &WindowService::size);
}

}  // namespace

void bind_bluefog(py::module_& m) {
  bind_neighbor_allreduce(m);
  bind_neighbor_allgather(m);
  bind_window_service(m);
}

}  // namespace bagua::python
