// Ripples' group generator service (bagua/runtime/group_generator_service.h)
// and the low-precision P-Reduce (bagua/ops/low_precision_partial_allreduce.h)
// for bagua.torch_api.algorithms.partial_allreduce. Groups cross as
// (id, ranks) tuples, the history as tuples, so that this unit needs no
// class of the engine's binding.
#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "bagua/ops/low_precision_partial_allreduce.h"
#include "bagua/runtime/group_generator_service.h"
#include "bindings.h"

namespace bagua::python {

namespace {

using GroupTuple = std::tuple<std::uint64_t, std::vector<int>>;

GroupGeneratorOptions service_options(int world_size, int group_size, const std::string& mode,
                                      std::optional<std::int64_t> slowdown_threshold,
                                      std::optional<int> local_size, bool inter_intra,
                                      std::uint64_t seed) {
  GroupGeneratorOptions options;
  options.world_size = world_size;
  options.group_size = group_size;
  options.mode = parse_group_generation_mode(mode);
  options.slowdown_threshold = slowdown_threshold;
  options.local_size = local_size;
  options.inter_intra = inter_intra;
  options.seed = seed;
  return options;
}

}  // namespace

void bind_group_generator(py::module_& m) {
  m.def(
      "low_precision_partial_allreduce",
      [](Communicator& comm, const TensorView& buffer, const std::vector<int>& members,
         std::uint64_t group_id) {
        low_precision_partial_allreduce(comm, buffer, members, group_id);
      },
      py::arg("comm"), py::arg("buffer"), py::arg("members"), py::arg("group_id"), ReleaseGil());
  py::class_<GroupGeneratorService, std::shared_ptr<GroupGeneratorService>>(m,
                                                                            "GroupGeneratorService")
      .def(
          py::init([](Communicator& comm, int group_size, const std::string& mode,
                      std::optional<std::int64_t> slowdown_threshold, std::optional<int> local_size,
                      bool inter_intra, std::uint64_t seed, int host_rank) {
            return std::make_shared<GroupGeneratorService>(
                comm,
                service_options(comm.size(), group_size, mode, slowdown_threshold, local_size,
                                inter_intra, seed),
                host_rank);
          }),
          py::arg("comm"), py::arg("group_size"), py::arg("mode"),
          py::arg("slowdown_threshold") = std::nullopt, py::arg("local_size") = std::nullopt,
          py::arg("inter_intra") = false, py::arg("seed") = 0, py::arg("host_rank") = 0,
          ReleaseGil())
      .def(
          "acquire",
          [](GroupGeneratorService& s) -> std::optional<GroupTuple> {
            auto group = s.acquire();
            if (!group) return std::nullopt;
            return GroupTuple{group->id, group->ranks};
          },
          ReleaseGil())
      .def("complete", &GroupGeneratorService::complete, py::arg("group_id"), ReleaseGil())
      .def("leave", &GroupGeneratorService::leave, ReleaseGil())
      .def("close", &GroupGeneratorService::close, ReleaseGil())
      .def_property_readonly("rank", &GroupGeneratorService::rank)
      .def_property_readonly("host_rank", &GroupGeneratorService::host_rank)
      .def("engine_stats",
           [](const GroupGeneratorService& s) {
             const auto st = s.engine_stats();
             py::dict d;
             d["requests"] = st.requests;
             d["groups"] = st.groups;
             d["solo"] = st.solo;
             d["mean_group_size"] = st.mean_group_size;
             d["max_buffer_len"] = st.max_buffer_len;
             d["divisions"] = st.divisions;
             return d;
           })
      .def("history",
           [](const GroupGeneratorService& s) {
             py::list out;
             for (const auto& g : s.history()) {
               out.append(py::make_tuple(g.group.id, g.group.ranks, g.t_start, g.t_end));
             }
             return out;
           })
      .def("acquire_latencies_ms", &GroupGeneratorService::acquire_latencies_ms);
}

}  // namespace bagua::python
