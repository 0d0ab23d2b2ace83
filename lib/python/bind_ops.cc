// Ops: their options as Python classes, Bucket with one append_* method per
// op (taking the op's options object), and the handles of the ops that are
// driven from Python after registration.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bagua/bagua.h"
#include "bindings.h"

namespace bagua::python {
namespace {

using CommPtr = std::shared_ptr<Communicator>;
using HierarchyPtr = std::shared_ptr<HierarchicalComms>;
using BucketClass = py::class_<Bucket, std::shared_ptr<Bucket>>;

std::string flag(bool value) { return value ? "True" : "False"; }

void bind_peer_selection(py::module_& m) {
  py::enum_<PeerSelection>(m, "PeerSelection",
                           "Who a rank exchanges weights with (peer_selection.h)")
      .value("ALL", PeerSelection::kAll)
      .value("SHIFT_ONE", PeerSelection::kShiftOne)
      .value("RING", PeerSelection::kRing);
  m.def(
      "parse_peer_selection", [](const std::string& name) { return parse_peer_selection(name); },
      py::arg("name"),
      "'all', 'shift_one' or 'ring' as a PeerSelection (InvalidArgumentError otherwise)");
}

void bind_centralized_options(py::module_& m) {
  using C = CentralizedSynchronousOptions;
  py::class_<C>(m, "CentralizedSynchronousOptions")
      .def(py::init([](bool hierarchical, bool average, bool scattergather) {
             return C{
                 .hierarchical = hierarchical, .average = average, .scattergather = scattergather};
           }),
           py::kw_only(), py::arg("hierarchical") = C{}.hierarchical,
           py::arg("average") = C{}.average, py::arg("scattergather") = C{}.scattergather)
      .def_readwrite("hierarchical", &C::hierarchical)
      .def_readwrite("average", &C::average)
      .def_readwrite("scattergather", &C::scattergather)
      .def("__repr__", [](const C& o) {
        return "CentralizedSynchronousOptions(hierarchical=" + flag(o.hierarchical) +
               ", average=" + flag(o.average) + ", scattergather=" + flag(o.scattergather) + ")";
      });
  using L = CentralizedLowPrecisionOptions;
  py::class_<L>(m, "CentralizedLowPrecisionOptions")
      .def(py::init([](bool hierarchical, bool average, bool error_feedback,
                       std::int64_t segment_elements) {
             return L{.hierarchical = hierarchical,
                      .average = average,
                      .error_feedback = error_feedback,
                      .segment_elements = segment_elements};
           }),
           py::kw_only(), py::arg("hierarchical") = L{}.hierarchical,
           py::arg("average") = L{}.average, py::arg("error_feedback") = L{}.error_feedback,
           py::arg("segment_elements") = L{}.segment_elements)
      .def_readwrite("hierarchical", &L::hierarchical)
      .def_readwrite("average", &L::average)
      .def_readwrite("error_feedback", &L::error_feedback)
      .def_readwrite("segment_elements", &L::segment_elements)
      .def("__repr__", [](const L& o) {
        return "CentralizedLowPrecisionOptions(hierarchical=" + flag(o.hierarchical) +
               ", average=" + flag(o.average) + ", error_feedback=" + flag(o.error_feedback) +
               ", segment_elements=" + std::to_string(o.segment_elements) + ")";
      });
  using H = CentralizedHalfPrecisionOptions;
  py::class_<H>(m, "CentralizedHalfPrecisionOptions")
      .def(py::init([](bool hierarchical, bool average) {
             return H{.hierarchical = hierarchical, .average = average};
           }),
           py::kw_only(), py::arg("hierarchical") = H{}.hierarchical,
           py::arg("average") = H{}.average)
      .def_readwrite("hierarchical", &H::hierarchical)
      .def_readwrite("average", &H::average)
      .def("__repr__", [](const H& o) {
        return "CentralizedHalfPrecisionOptions(hierarchical=" + flag(o.hierarchical) +
               ", average=" + flag(o.average) + ")";
      });
}

void bind_decentralized_options(py::module_& m) {
  using L = LowPrecisionDecentralizedOptions;
  py::class_<L>(m, "LowPrecisionDecentralizedOptions")
      .def(py::init([](bool hierarchical) { return L{.hierarchical = hierarchical}; }),
           py::kw_only(), py::arg("hierarchical") = L{}.hierarchical)
      .def_readwrite("hierarchical", &L::hierarchical)
      .def("__repr__", [](const L& o) {
        return "LowPrecisionDecentralizedOptions(hierarchical=" + flag(o.hierarchical) + ")";
      });
  using N = LowPrecisionNeighborOptions;
  using Weights = std::vector<std::pair<int, double>>;
  py::class_<N>(m, "LowPrecisionNeighborOptions")
      .def(py::init([](double self_weight, const Weights& sources, std::vector<int> destinations,
                       bool check_pattern) {
             N o{.self_weight = self_weight,
                 .sources = {},
                 .destinations = std::move(destinations),
                 .check_pattern = check_pattern};
             for (const auto& [rank, weight] : sources) o.sources.push_back({rank, weight});
             return o;
           }),
           py::kw_only(), py::arg("self_weight") = N{}.self_weight, py::arg("sources") = Weights{},
           py::arg("destinations") = std::vector<int>{},
           py::arg("check_pattern") = N{}.check_pattern)
      .def_readonly("self_weight", &N::self_weight)
      .def_readonly("destinations", &N::destinations)
      .def_property_readonly("sources", [](const N& o) {
        Weights out;
        for (const auto& s : o.sources) out.emplace_back(s.rank, s.weight);
        return out;
      });
  using D = DecentralizedSynchronousOptions;
  py::class_<D>(m, "DecentralizedSynchronousOptions")
      .def(py::init([](bool hierarchical, PeerSelection peer_selection) {
             return D{.hierarchical = hierarchical, .peer_selection = peer_selection};
           }),
           py::kw_only(), py::arg("hierarchical") = D{}.hierarchical,
           py::arg("peer_selection") = D{}.peer_selection)
      .def_readwrite("hierarchical", &D::hierarchical)
      .def_readwrite("peer_selection", &D::peer_selection)
      .def("__repr__", [](const D& o) {
        return "DecentralizedSynchronousOptions(hierarchical=" + flag(o.hierarchical) +
               ", peer_selection=" + std::string(to_string(o.peer_selection)) + ")";
      });
}

void bind_async_options(py::module_& m) {
  using A = AsyncModelAverageOptions;
  py::class_<A>(m, "AsyncModelAverageOptions")
      // max_staleness_steps: None (or 0) is unbounded.
      .def(py::init([](PeerSelection peer_selection, std::int64_t sync_interval_ms,
                       std::optional<std::int64_t> max_staleness_steps) {
             return A{.peer_selection = peer_selection,
                      .sync_interval = std::chrono::milliseconds(sync_interval_ms),
                      .max_staleness_steps = max_staleness_steps.value_or(0)};
           }),
           py::kw_only(), py::arg("peer_selection") = A{}.peer_selection,
           py::arg("sync_interval_ms") = A{}.sync_interval.count(),
           py::arg("max_staleness_steps") = std::nullopt)
      .def_readwrite("peer_selection", &A::peer_selection)
      .def_readwrite("max_staleness_steps", &A::max_staleness_steps)
      .def_property(
          "sync_interval_ms", [](const A& o) { return o.sync_interval.count(); },
          [](A& o, std::int64_t ms) { o.sync_interval = std::chrono::milliseconds(ms); })
      .def("__repr__", [](const A& o) {
        return "AsyncModelAverageOptions(peer_selection=" +
               std::string(to_string(o.peer_selection)) +
               ", sync_interval_ms=" + std::to_string(o.sync_interval.count()) +
               ", max_staleness_steps=" + std::to_string(o.max_staleness_steps) + ")";
      });
}

void require_comm_supports(const Bucket& b, const Communicator& comm, const char* op) {
  BAGUA_CHECK_ARG(comm.supports(b.device().type),
                  "{}: bucket '{}' is on {} but the {} communicator cannot reach that memory "
                  "(use BAGUA_BACKEND=nccl for CUDA tensors)",
                  op, b.name(), b.device().str(), comm.backend_name());
}

// The append_* implementations: check that the communicator reaches the
// bucket's memory, build the op from its options, append it.
void append_centralized_synchronous(Bucket& b, CommPtr global, HierarchyPtr hierarchy,
                                    const CentralizedSynchronousOptions& options) {
  if (global) require_comm_supports(b, *global, "append_centralized_synchronous_op");
  b.append_op(
      std::make_unique<CentralizedSynchronousOp>(std::move(global), std::move(hierarchy), options));
}

std::shared_ptr<CentralizedLowPrecisionOp> append_centralized_low_precision(
    Bucket& b, CommPtr global, HierarchyPtr hierarchy,
    const CentralizedLowPrecisionOptions& options) {
  if (global) require_comm_supports(b, *global, "append_centralized_low_precision_op");
  auto op = std::make_shared<CentralizedLowPrecisionOp>(std::move(global), std::move(hierarchy),
                                                        b.dtype(), options);
  b.append_op(op);
  return op;
}

void append_centralized_half_precision(Bucket& b, CommPtr global, HierarchyPtr hierarchy,
                                       const CentralizedHalfPrecisionOptions& options) {
  if (global) require_comm_supports(b, *global, "append_centralized_half_precision_op");
  b.append_op(std::make_unique<CentralizedHalfPrecisionOp>(std::move(global), std::move(hierarchy),
                                                           b.dtype(), options));
}

void append_low_precision_decentralized(Bucket& b, CommPtr global, HierarchyPtr hierarchy,
                                        const TensorView& weight, const TensorView& left,
                                        const TensorView& right,
                                        const LowPrecisionDecentralizedOptions& options) {
  if (global) require_comm_supports(b, *global, "append_low_precision_decentralized_op");
  b.append_op(std::make_unique<LowPrecisionDecentralizedOp>(
      std::move(global), std::move(hierarchy), weight, left, right, b.numel(), b.dtype(), options));
}

std::shared_ptr<DecentralizedSynchronousOp> append_decentralized_synchronous(
    Bucket& b, CommPtr global, HierarchyPtr hierarchy, const TensorView& peer_weight,
    const DecentralizedSynchronousOptions& options) {
  if (global) require_comm_supports(b, *global, "append_decentralized_synchronous_op");
  BAGUA_CHECK_ARG(peer_weight.device == b.device(),
                  "append_decentralized_synchronous_op: peer_weight is on {}, bucket '{}' on {}",
                  peer_weight.device.str(), b.name(), b.device().str());
  auto op = std::make_shared<DecentralizedSynchronousOp>(
      std::move(global), std::move(hierarchy), peer_weight, b.numel(), b.dtype(), options);
  b.append_op(op);
  return op;
}

std::shared_ptr<NeighborAllreduceOp> append_neighbor_allreduce(Bucket& b, CommPtr comm,
                                                               const TensorView& peer_weight) {
  if (comm) require_comm_supports(b, *comm, "append_neighbor_allreduce_op");
  BAGUA_CHECK_ARG(peer_weight.device == b.device(),
                  "append_neighbor_allreduce_op: peer_weight is on {}, bucket '{}' on {}",
                  peer_weight.device.str(), b.name(), b.device().str());
  auto op =
      std::make_shared<NeighborAllreduceOp>(std::move(comm), peer_weight, b.numel(), b.dtype());
  b.append_op(op);
  return op;
}

void append_low_precision_neighbor_allreduce(Bucket& b, CommPtr comm, const TensorView& weight,
                                             const std::vector<TensorView>& replicas,
                                             const LowPrecisionNeighborOptions& options) {
  BAGUA_CHECK_ARG(comm != nullptr, "append_low_precision_neighbor_allreduce_op: no communicator");
  require_comm_supports(b, *comm, "append_low_precision_neighbor_allreduce_op");
  BAGUA_CHECK_ARG(weight.device == b.device(),
                  "append_low_precision_neighbor_allreduce_op: weight is on {}, bucket '{}' on {}",
                  weight.device.str(), b.name(), b.device().str());
  b.append_op(std::make_unique<LowPrecisionNeighborAllreduceOp>(std::move(comm), weight, replicas,
                                                                b.numel(), b.dtype(), options));
}

std::shared_ptr<AsyncModelAverageOp> append_asynchronous_model_average(
    Bucket& b, CommPtr dedicated, const AsyncModelAverageOptions& options) {
  if (dedicated) require_comm_supports(b, *dedicated, "append_asynchronous_model_average_op");
  auto op = std::make_shared<AsyncModelAverageOp>(std::move(dedicated), b, options);
  b.append_op(op);
  return op;
}

// matrices: (index in the bucket, rows, cols, q, error) per compressed tensor;
// deferred: none, or (p_prev, q_prev) per matrix (LowRankTensor).
std::shared_ptr<PowerSGDOp> append_powersgd(
    Bucket& b, CommPtr comm,
    const std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, TensorView, TensorView>>&
        matrices,
    const PowerSGDOptions& options,
    const std::vector<std::pair<TensorView, TensorView>>& deferred) {
  BAGUA_CHECK_ARG(comm != nullptr, "append_powersgd_op: no communicator");
  require_comm_supports(b, *comm, "append_powersgd_op");
  BAGUA_CHECK_ARG(deferred.empty() || deferred.size() == matrices.size(),
                  "append_powersgd_op: {} deferred errors for {} matrices", deferred.size(),
                  matrices.size());
  std::vector<LowRankTensor> list;
  list.reserve(matrices.size());
  for (const auto& [index, rows, cols, q, error] : matrices) {
    const std::size_t k = list.size();
    const TensorView none{};
    list.push_back({.index = index,
                    .rows = rows,
                    .cols = cols,
                    .q = q,
                    .error = error,
                    .p_prev = deferred.empty() ? none : deferred[k].first,
                    .q_prev = deferred.empty() ? none : deferred[k].second});
  }
  auto op = std::make_shared<PowerSGDOp>(std::move(comm), b, std::move(list), options);
  b.append_op(op);
  return op;
}

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

void bind_bucket_class(BucketClass& c) {
  c.def(py::init(
            [](std::string name, const std::vector<std::pair<std::string, TensorView>>& tensors) {
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
      .def_property_readonly("op_bytes_sent",
                             [](const Bucket& b) {
                               std::vector<std::int64_t> bytes;
                               bytes.reserve(b.ops().size());
                               for (const auto& op : b.ops()) bytes.push_back(op->bytes_sent());
                               return bytes;
                             })
      .def("clear_ops", &Bucket::clear_ops)
      .def("append_python_op", [](Bucket& b, py::function fn) {
        b.append_op(std::make_unique<CallbackOp>(python_callback(std::move(fn))));
      });
}

// One method per op: communicator(s), the op's tensors, its options object.
void bind_bucket_ops(BucketClass& c) {
  c.def("append_centralized_synchronous_op", &append_centralized_synchronous,
        py::arg("communicator"), py::arg("hierarchy"),
        py::arg("options") = CentralizedSynchronousOptions{})
      .def("append_centralized_low_precision_op", &append_centralized_low_precision,
           py::arg("communicator"), py::arg("hierarchy"),
           py::arg("options") = CentralizedLowPrecisionOptions{})
      .def("append_centralized_half_precision_op", &append_centralized_half_precision,
           py::arg("communicator"), py::arg("hierarchy"),
           py::arg("options") = CentralizedHalfPrecisionOptions{})
      .def("append_low_precision_decentralized_op", &append_low_precision_decentralized,
           py::arg("communicator"), py::arg("hierarchy"), py::arg("weight"), py::arg("left"),
           py::arg("right"), py::arg("options") = LowPrecisionDecentralizedOptions{})
      .def("append_decentralized_synchronous_op", &append_decentralized_synchronous,
           py::arg("communicator"), py::arg("hierarchy"), py::arg("peer_weight"),
           py::arg("options") = DecentralizedSynchronousOptions{})
      .def("append_neighbor_allreduce_op", &append_neighbor_allreduce, py::arg("communicator"),
           py::arg("peer_weight"))
      .def("append_low_precision_neighbor_allreduce_op", &append_low_precision_neighbor_allreduce,
           py::arg("communicator"), py::arg("weight"), py::arg("replicas"), py::arg("options"))
      .def("append_asynchronous_model_average_op", &append_asynchronous_model_average,
           py::arg("communicator"), py::arg("options") = AsyncModelAverageOptions{})
      .def("append_powersgd_op", &append_powersgd, py::arg("communicator"), py::arg("matrices"),
           py::arg("options") = PowerSGDOptions{},
           py::arg("deferred") = std::vector<std::pair<TensorView, TensorView>>{});
}

// PowerSGD's math on one matrix without communication (the step at world
// size 1): M += error, P = M Q, orthogonalize P, Q = M^T P, error = M - P Q^T,
// M = P Q^T. For tests against the formulas and for timing the math.
void low_rank_step(const TensorView& m, const TensorView& error, const TensorView& q,
                   const TensorView& p, std::int64_t rows, std::int64_t cols, std::int64_t rank,
                   double epsilon) {
  const LowRankShape s{rows, cols, rank};
  for (const auto* v : {&error, &q, &p}) {
    BAGUA_CHECK_ARG(v->numel == 0 || (v->dtype == m.dtype && v->device == m.device),
                    "low_rank_step: {} does not match m {}", v->describe(), m.describe());
  }
  BAGUA_CHECK_ARG(rows >= 1 && cols >= 1 && rank >= 1 && m.numel == rows * cols &&
                      q.numel == cols * rank && p.numel == rows * rank &&
                      (error.numel == 0 || error.numel == m.numel),
                  "low_rank_step: m {} (q {}, p {}) is not {} x {} at rank {}", m.describe(),
                  q.describe(), p.describe(), rows, cols, rank);
  auto c = compute_for(m.device);
  low_rank_project(*c, s, m, error, q, p);
  orthogonalize_columns(*c, s, p, epsilon);
  low_rank_project_back(*c, s, m, p, q);
  low_rank_reconstruct(*c, s, m, error, p, q);
  c->finish("low_rank_step", env().comm_timeout);
}

// The error a deferred PowerSGD state stands for: error = base - p_prev
// q_prev^T (host memory; low_rank_steps.h), for checkpoints.
void low_rank_deferred_error_of(const TensorView& base, const TensorView& p_prev,
                                const TensorView& q_prev, const TensorView& error,
                                std::int64_t rows, std::int64_t cols, std::int64_t rank) {
  for (const auto* v : {&p_prev, &q_prev, &error}) {
    BAGUA_CHECK_ARG(v->dtype == base.dtype && v->device == base.device,
                    "low_rank_deferred_error: {} does not match base {}", v->describe(),
                    base.describe());
  }
  BAGUA_CHECK_ARG(
      rows >= 1 && cols >= 1 && rank >= 1 && base.numel == rows * cols &&
          error.numel == base.numel && p_prev.numel == rows * rank && q_prev.numel == cols * rank,
      "low_rank_deferred_error: base {} (p_prev {}, q_prev {}) is not {} x {} at rank {}",
      base.describe(), p_prev.describe(), q_prev.describe(), rows, cols, rank);
  low_rank_deferred_error({rows, cols, rank}, base, p_prev, q_prev, error);
}

void bind_powersgd(py::module_& m) {
  using O = PowerSGDOptions;
  py::class_<O>(m, "PowerSGDOptions")
      .def(py::init([](std::int64_t rank, double epsilon, bool low_precision) {
             return O{.rank = rank,
                      .orthogonalization_epsilon = epsilon,
                      .low_precision = low_precision};
           }),
           py::kw_only(), py::arg("rank") = O{}.rank,
           py::arg("orthogonalization_epsilon") = O{}.orthogonalization_epsilon,
           py::arg("low_precision") = O{}.low_precision)
      .def_readwrite("rank", &O::rank)
      .def_readwrite("orthogonalization_epsilon", &O::orthogonalization_epsilon)
      .def_readwrite("low_precision", &O::low_precision)
      .def("__repr__", [](const O& o) {
        return "PowerSGDOptions(rank=" + std::to_string(o.rank) +
               ", orthogonalization_epsilon=" + std::to_string(o.orthogonalization_epsilon) +
               ", low_precision=" + flag(o.low_precision) + ")";
      });
  py::class_<PowerSGDOp, CommOp, std::shared_ptr<PowerSGDOp>>(m, "PowerSGDOp")
      .def_property("compressing", &PowerSGDOp::compressing, &PowerSGDOp::set_compressing)
      .def_property_readonly("exchanged_bytes", &PowerSGDOp::exchanged_bytes)
      .def_property_readonly("uncompressed_bytes", &PowerSGDOp::uncompressed_bytes);
  m.def("low_rank_step", &low_rank_step, py::arg("m"), py::arg("error"), py::arg("q"), py::arg("p"),
        py::arg("rows"), py::arg("cols"), py::arg("rank"), py::arg("epsilon") = 0.0, ReleaseGil(),
        "PowerSGD's math on one rows x cols matrix at world size 1, in place (m, error, q; p is "
        "scratch; error may have no elements)");
  m.def("host_threads", &host_threads,
        "Threads PowerSGD's host passes may use (core/host_threads.h); 1 unless set");
  m.def("host_ranges_cut", &host_ranges_cut,
        "Host passes cut into several ranges so far (core/host_threads.h; for tests)");
  m.def("set_host_threads", &set_host_threads, py::arg("threads"),
        "Sets the threads PowerSGD's host passes may use, 1 to 256 (the bits do not change)");
  m.def("low_rank_deferred_error", &low_rank_deferred_error_of, py::arg("base"), py::arg("p_prev"),
        py::arg("q_prev"), py::arg("error"), py::arg("rows"), py::arg("cols"), py::arg("rank"),
        ReleaseGil(),
        "The error a deferred PowerSGD state stands for, into error: base - p_prev q_prev^T");
}

// Error feedback's residuals, for checkpoints (see centralized_low_precision.h).
void bind_low_precision_handle(py::module_& m) {
  py::class_<CentralizedLowPrecisionOp, CommOp, std::shared_ptr<CentralizedLowPrecisionOp>>(
      m, "CentralizedLowPrecisionOp")
      .def("residual_numel", &CentralizedLowPrecisionOp::residual_numel, py::arg("server"))
      .def("pipelined_segments", &CentralizedLowPrecisionOp::pipelined_segments,
           "Segments run by the host pipeline so far (see C_LP_S)")
      .def("copy_residual_to", &CentralizedLowPrecisionOp::copy_residual_to, py::arg("server"),
           py::arg("out"), ReleaseGil())
      .def("set_residual", &CentralizedLowPrecisionOp::set_residual, py::arg("server"),
           py::arg("values"), ReleaseGil());
}

void bind_decentralized_handle(py::module_& m) {
  py::class_<DecentralizedSynchronousOp, CommOp, std::shared_ptr<DecentralizedSynchronousOp>>(
      m, "DecentralizedSynchronousOp")
      // cuda_stream (CUDA bucket): the caller's stream as an integer; the copy
      // is ordered on the device after the kernels there, without a host wait.
      // Without it the host waits for the copy.
      .def(
          "copy_back_peer_weight",
          [](DecentralizedSynchronousOp& op, Bucket& bucket, std::optional<std::uintptr_t> stream) {
            if (stream) {
              op.copy_back_peer_weight_on_stream(bucket, as_stream(*stream));
            } else {
              op.copy_back_peer_weight(bucket);
            }
          },
          py::arg("bucket"), py::arg("cuda_stream") = std::nullopt, ReleaseGil())
      .def_property("communication_step", &DecentralizedSynchronousOp::communication_step,
                    &DecentralizedSynchronousOp::set_communication_step);
  py::class_<NeighborAllreduceOp, CommOp, std::shared_ptr<NeighborAllreduceOp>>(
      m, "NeighborAllreduceOp")
      .def("set_pattern", &NeighborAllreduceOp::set_pattern, py::arg("options"))
      .def("copy_back_peer_weight", &NeighborAllreduceOp::copy_back_peer_weight, py::arg("bucket"),
           ReleaseGil());
}

// The raw per-op figures; the algorithm (Python) turns them into its stats().
py::dict async_stats_dict(const AsyncRoundStats& s) {
  py::dict d;
  d["rounds"] = s.rounds;
  d["steps"] = s.steps;
  d["last_round_steps"] = s.last_round_steps;
  d["max_round_steps"] = s.max_round_steps;
  d["steps_in_rounds"] = s.steps_in_rounds;
  d["last_round_ms"] = s.last_round_ms;
  d["max_round_ms"] = s.max_round_ms;
  d["total_round_ms"] = s.total_round_ms;
  d["last_drift_sq"] = s.last_drift_sq;
  d["max_drift_sq"] = s.max_drift_sq;
  d["last_average_sq"] = s.last_average_sq;
  d["staleness_waits"] = s.staleness_waits;
  d["staleness_wait_ms"] = s.staleness_wait_ms;
  return d;
}

// lock_weight / unlock_weight: cuda_stream (CUDA weights) is the training
// stream as an integer, so the background work is ordered after the kernels
// using the weights.
void bind_async_handle(py::module_& m) {
  using Op = AsyncModelAverageOp;
  py::class_<Op, CommOp, std::shared_ptr<Op>>(m, "AsyncModelAverageOp")
      .def(
          "lock_weight",
          [](Op& op, std::optional<std::uintptr_t> stream) {
            stream ? op.lock_weight_on_stream(as_stream(*stream)) : op.lock_weight();
          },
          py::arg("cuda_stream") = std::nullopt, ReleaseGil())
      .def(
          "unlock_weight",
          [](Op& op, std::optional<std::uintptr_t> stream) {
            stream ? op.unlock_weight_on_stream(as_stream(*stream)) : op.unlock_weight();
          },
          py::arg("cuda_stream") = std::nullopt, ReleaseGil())
      .def("abort", &Op::abort, ReleaseGil())
      .def("resume", &Op::resume, ReleaseGil())
      .def("reset", &Op::reset, ReleaseGil())
      .def("get_status", [](const Op& op) { return std::string(to_string(op.status())); })
      .def("rethrow_failure", &Op::rethrow_failure)
      .def_property_readonly("completed_rounds", &Op::completed_rounds)
      .def("count_step", &Op::count_step)
      .def("wait_within_staleness", &Op::wait_within_staleness, ReleaseGil())
      .def("set_timeline", &Op::set_timeline, py::arg("timeline"))
      .def("stats", [](const Op& op) { return async_stats_dict(op.stats()); });
}

}  // namespace

void bind_ops(py::module_& m) {
  bind_peer_selection(m);
  bind_centralized_options(m);
  bind_decentralized_options(m);
  bind_async_options(m);

  py::class_<CommOp, std::shared_ptr<CommOp>>(m, "CommOp")
      .def_property_readonly("name", [](const CommOp& op) { return std::string(op.name()); })
      .def_property_readonly("bytes_sent", &CommOp::bytes_sent);
  bind_low_precision_handle(m);
  bind_powersgd(m);
  bind_decentralized_handle(m);
  bind_async_handle(m);

  BucketClass bucket(m, "Bucket");
  bind_bucket_class(bucket);
  bind_bucket_ops(bucket);
}

}  // namespace bagua::python
