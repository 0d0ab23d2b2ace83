// Ripples' network-free parts: the static schedule
// (include/bagua/ops/static_schedule.h) and the group generator engine
// (include/bagua/runtime/group_generator.h). The Python face with argument
// checks and docstrings is algorithms/_ripples_engine.py.
//
// Also the service that runs the engine for the other ranks
// (include/bagua/runtime/group_generator_service.h) and the low-precision
// P-Reduce (include/bagua/ops/low_precision_partial_allreduce.h), for
// algorithms/partial_allreduce.py; these communicate, so they release the GIL.
//
// GroupGeneratorEngine.request / poll return a Group, None (random mode: not
// granted yet, poll later) or the sentinel GroupGeneratorEngine.DONE. Engine
// calls are short and never block, so they keep the GIL.
#include <fmt/ranges.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bagua/ops/low_precision_partial_allreduce.h"
#include "bagua/ops/static_schedule.h"
#include "bagua/runtime/group_generator.h"
#include "bagua/runtime/group_generator_service.h"
#include "bindings.h"

namespace bagua::python {
namespace {

// The type of GroupGeneratorEngine.DONE; one instance exists.
struct GroupGeneratorDone {};

py::object& done_sentinel() {
  // Leaked on purpose: it lives as long as the interpreter, and dropping it at
  // exit after Python finalised would touch a dead interpreter.
  static auto* done = new py::object(py::cast(GroupGeneratorDone{}));
  return *done;
}

py::object to_python(const GroupReply& reply) {
  switch (reply.kind) {
    case ReplyKind::kGroup: return py::cast(reply.group);
    case ReplyKind::kWait: return py::none();
    case ReplyKind::kDone: return done_sentinel();
  }
  return py::none();
}

py::dict to_dict(const GroupGeneratorStats& s) {
  return py::dict(py::arg("requests") = s.requests, py::arg("groups") = s.groups,
                  py::arg("solo") = s.solo, py::arg("mean_group_size") = s.mean_group_size,
                  py::arg("max_buffer_len") = s.max_buffer_len, py::arg("divisions") = s.divisions,
                  py::arg("company") = s.company);
}

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

// The service and the low-precision P-Reduce, for algorithms/partial_allreduce.py.
void bind_group_generator_service(py::module_& m) {
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
      .def("acquire", &GroupGeneratorService::acquire, ReleaseGil(),
           "This rank's next Group (blocking), or None once it left and drained.")
      .def("complete", &GroupGeneratorService::complete, py::arg("group_id"), ReleaseGil())
      .def("leave", &GroupGeneratorService::leave, ReleaseGil())
      .def("linger", &GroupGeneratorService::linger, ReleaseGil())
      .def("close", &GroupGeneratorService::close, ReleaseGil())
      .def("final_round_id", &GroupGeneratorService::final_round_id,
           "After linger and DONE: the first id after every group, when every rank lingered "
           "to the end (the same on every rank); else None.")
      .def_property_readonly("rank", &GroupGeneratorService::rank)
      .def_property_readonly("host_rank", &GroupGeneratorService::host_rank)
      .def("engine_stats", [](const GroupGeneratorService& s) { return to_dict(s.engine_stats()); })
      .def("history",
           [](const GroupGeneratorService& s) {
             py::list out;
             for (const auto& g : s.history()) {
               out.append(py::make_tuple(g.group.id, g.group.ranks, g.t_start, g.t_end));
             }
             return out;
           })
      .def("acquire_latencies_ms", &GroupGeneratorService::acquire_latencies_ms)
      .def("max_buffer_len", &GroupGeneratorService::max_buffer_len,
           "The longest group buffer any rank had, as of this rank's last group.");
}

}  // namespace

void bind_ripples(py::module_& m) {
  m.def(
      "static_schedule",
      [](int rank, std::int64_t step, int world_size, int local_size) {
        return static_schedule(rank, step, world_size, local_size);
      },
      py::arg("rank"), py::arg("step"), py::arg("world_size"), py::arg("local_size"),
      "The sorted group `rank` P-Reduces with at `step` under the static schedule: the "
      "paper's groups, its idle ranks grouped across nodes ([rank] alone: no sync at this "
      "step).");
  m.def(
      "paper_static_schedule",
      [](int rank, std::int64_t step, int world_size, int local_size) {
        return paper_static_schedule(rank, step, world_size, local_size);
      },
      py::arg("rank"), py::arg("step"), py::arg("world_size"), py::arg("local_size"),
      "The group of the Ripples paper's static table, idle ranks left alone.");

  py::class_<Group>(m, "Group", "A group of ranks that P-Reduce together, with its global id.")
      .def(py::init([](std::uint64_t id, std::vector<int> ranks) {
             return Group{.id = id, .ranks = std::move(ranks)};
           }),
           py::arg("id"), py::arg("ranks"))
      .def_readonly("id", &Group::id)
      .def_readonly("ranks", &Group::ranks)
      .def(py::self == py::self)
      .def("__hash__",
           [](const Group& g) {
             py::tuple ranks = py::cast(g.ranks);
             return py::hash(py::make_tuple(g.id, ranks));
           })
      .def("__repr__", [](const Group& g) {
        return fmt::format("Group(id={}, ranks=[{}])", g.id, fmt::join(g.ranks, ", "));
      });

  py::class_<GroupGeneratorDone>(m, "GroupGeneratorDone",
                                 "The type of GroupGeneratorEngine.DONE (a single instance).")
      .def("__repr__", [](const GroupGeneratorDone&) { return "GroupGeneratorEngine.DONE"; });

  using E = GroupGeneratorEngine;
  py::class_<E> engine(m, "GroupGeneratorEngine",
                       "Ripples' group generator as a pure state machine (no network).");
  engine
      .def(
          py::init([](int world_size, int group_size, const std::string& mode,
                      std::optional<std::int64_t> slowdown_threshold, std::optional<int> local_size,
                      bool inter_intra, std::uint64_t seed, int company_every) {
            return E(GroupGeneratorOptions{.world_size = world_size,
                                           .group_size = group_size,
                                           .mode = parse_group_generation_mode(mode),
                                           .slowdown_threshold = slowdown_threshold,
                                           .local_size = local_size,
                                           .inter_intra = inter_intra,
                                           .company_every = company_every,
                                           .seed = seed});
          }),
          py::arg("world_size"), py::arg("group_size") = 3, py::arg("mode") = "smart",
          py::arg("slowdown_threshold") = std::nullopt, py::arg("local_size") = std::nullopt,
          py::arg("inter_intra") = false, py::arg("seed") = 0, py::arg("company_every") = 1)
      .def(
          "request", [](E& e, int rank) { return to_python(e.request(rank)); }, py::arg("rank"))
      .def(
          "poll", [](E& e, int rank) { return to_python(e.poll(rank)); }, py::arg("rank"))
      .def("complete", &E::complete, py::arg("rank"), py::arg("group_id"))
      .def("leave", &E::leave, py::arg("rank"))
      .def("linger", &E::linger, py::arg("rank"))
      .def("final_round_id", &E::final_round_id)
      .def("is_lingering", &E::is_lingering, py::arg("rank"))
      .def("lock_vector", &E::lock_vector)
      .def("buffer", &E::buffer, py::arg("rank"))
      .def("counters", &E::counters)
      .def("stats", [](const E& e) { return to_dict(e.stats()); })
      .def("waiting", &E::waiting)
      .def("pending", &E::pending)
      .def("executing", &E::executing, py::arg("rank"))
      .def("has_left", &E::has_left, py::arg("rank"))
      .def("outstanding_groups", &E::outstanding_groups)
      .def("drained", &E::drained)
      .def_property_readonly("world_size", &E::world_size)
      .def_property_readonly("group_size", [](const E& e) { return e.options().group_size; })
      .def_property_readonly("mode",
                             [](const E& e) { return std::string(to_string(e.options().mode)); });
  engine.attr("DONE") = done_sentinel();
  bind_group_generator_service(m);  // after Group, which it returns
}

}  // namespace bagua::python
