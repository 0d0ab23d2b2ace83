// Low-precision neighbour allreduce: D_LP_S (decentralized_low_precision.h)
// generalised from the ring to any static weighted graph, as a bucket op
// (LowPrecisionDecentralizedAlgorithm(topology=...)).
//
// Rank i keeps W (its own weights as its out-neighbours know them) and one
// replica X_j per in-neighbour j (its copy of j's W), all of the bucket's
// size and dtype. Run after the optimizer step, with x the bucket and
// w_ii, w_ij the weights rank i gives itself and its in-neighbours
// (BlueFog's GetRecvWeights):
//   d = w_ii W + sum_j w_ij X_j + (x - W) - W
//     computed in float32 as d = x; d += (w_ii - 2) W; d += w_ij X_j in
//     the order of `sources`;
//   send Q(d) to every out-neighbour, receive Q(d_j) from every in-neighbour;
//   X_j += Q^-1(Q(d_j));  x = W + Q^-1(Q(d));  W = x.
// Every rank applies the same decoded bytes, so rank i's W stays equal, bit
// for bit, to the replica X_i each of its out-neighbours keeps. Q is
// MinMaxUInt8 in the chunk layout of D_LP_S (chunked_layout.h).
//
// The pattern is static: given at registration, checked (ranks, no self,
// no repeats) then, and, with `check_pattern`, agreed by all ranks at the
// first execution (a small allgather: every send has its receive, same
// bucket size and dtype); a mismatch is an InvalidArgument on every rank.
// Every wait is bounded by the communicator's timeout; errors name the op,
// the bucket and the rank. Threading: as CommOp (the communication thread).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bagua/comm/communicator.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/core/errors.h"
#include "bagua/ops/decentralized_low_precision.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/low_precision_exchange.h"
#include "bagua/ops/neighbor_allreduce.h"
#include "bagua/ops/neighbor_pattern.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct LowPrecisionNeighborOptions {
  double self_weight = 1.0;             // w_ii
  std::vector<NeighborWeight> sources;  // in-neighbours j and w_ij, one replica each
  std::vector<int> destinations;        // out-neighbours
  bool check_pattern = true;            // agree on the pattern at the first execution
};

class LowPrecisionNeighborAllreduceOp final : public HierarchicalOp {
 public:
  static constexpr std::int64_t kChunkElements = LowPrecisionDecentralizedOp::kChunkElements;
  static constexpr std::string_view kName = "low_precision_neighbor_allreduce";

  // `replicas[k]` is this rank's copy of `options.sources[k]`'s weights.
  // weight and replicas start equal to the weights every rank starts from.
  LowPrecisionNeighborAllreduceOp(std::shared_ptr<Communicator> comm, TensorView weight,
                                  std::vector<TensorView> replicas, std::int64_t bucket_numel,
                                  DType bucket_dtype, LowPrecisionNeighborOptions options)
      : HierarchicalOp(kName, comm, nullptr, false),
        weight_(weight),
        replicas_(std::move(replicas)),
        options_(std::move(options)) {
    const std::string op = fmt::format("{} (rank {} of {})", kName, comm->rank(), comm->size());
    check_compressible(bucket_dtype, op);
    BAGUA_CHECK_ARG(replicas_.size() == options_.sources.size(),
                    "{}: one replica per source: {} sources, {} replicas", op,
                    options_.sources.size(), replicas_.size());
    std::vector<int> sources;
    for (const auto& s : options_.sources) {
      BAGUA_CHECK_ARG(std::isfinite(s.weight), "{}: the weight of source {} is {}", op, s.rank,
                      s.weight);
      sources.push_back(s.rank);
    }
    BAGUA_CHECK_ARG(std::isfinite(options_.self_weight), "{}: the self weight is {}", op,
                    options_.self_weight);
    check_neighbor_ranks(op, "the sources", sources, comm->rank(), comm->size());
    source_ranks_ = std::move(sources);
    check_neighbor_ranks(op, "the destinations", options_.destinations, comm->rank(), comm->size());
    BAGUA_CHECK_ARG(weight_.numel == bucket_numel && weight_.dtype == bucket_dtype,
                    "{}: the weight copy must match the bucket ({}[{}]), got {}", op,
                    to_string(bucket_dtype), bucket_numel, weight_.describe());
    for (std::size_t k = 0; k < replicas_.size(); ++k) {
      const TensorView& r = replicas_[k];
      BAGUA_CHECK_ARG(
          r.numel == bucket_numel && r.dtype == bucket_dtype && r.device == weight_.device,
          "{}: the replica of rank {} must match the bucket ({}[{}] on {}), got {}", op,
          options_.sources[k].rank, to_string(bucket_dtype), bucket_numel, weight_.device.str(),
          r.describe());
    }
  }

  std::string_view name() const override { return kName; }

  const LowPrecisionNeighborOptions& options() const { return options_; }

  void execute(Bucket& bucket) override {
    const std::string where = fmt::format("{} on bucket '{}' (rank {} of {})", kName, bucket.name(),
                                          global().rank(), global().size());
    BAGUA_CHECK_ARG(weight_.device == bucket.device(),
                    "{}: the weight copies are on {}, the bucket on {}", where,
                    weight_.device.str(), bucket.device().str());
    for_flat_bucket(bucket, [&](const TensorView& x) { step(x, bucket.name(), where); });
  }

 private:
  void step(const TensorView& x, const std::string& bucket_name, const std::string& where) {
    Communicator& comm = global();
    const std::uint64_t tag = sequence_.next_tag(bucket_name);
    if (options_.check_pattern && !pattern_agreed_ && comm.size() > 1) {
      NeighborPattern pattern{.op = where,
                              .tag = tag,
                              .dtype = x.dtype,
                              .numel = x.numel,
                              .sends = options_.destinations,
                              .receives = {}};
      for (const auto& s : options_.sources) pattern.receives.push_back(s.rank);
      check_neighbor_pattern(comm, pattern);
      pattern_agreed_ = true;
    }
    Compute& c = compute();
    const auto diff_block = c.scratch(static_cast<std::size_t>(x.numel) * sizeof(float));
    const TensorView diff = c.view(diff_block, x.numel, DType::kFloat32);
    mix(c, x, diff);
    exchange_low_precision_difference(c, comm,
                                      {.chunk_elements = kChunkElements,
                                       .sources = source_ranks_,
                                       .replicas = replicas_,
                                       .destinations = options_.destinations,
                                       .where = where},
                                      diff, weight_, x);
    c.finish(where, comm.timeout());
  }

  // diff (float32) = x + (w_ii - 2) W + sum_j w_ij X_j, term by term.
  void mix(Compute& c, const TensorView& x, const TensorView& diff) {
    c.convert(x, diff);
    CachingAllocator::Block wide_block;
    TensorView wide{};
    auto add = [&](double a, const TensorView& v) {
      if (v.dtype == DType::kFloat32) {
        c.axpby(a, v, 1.0, diff);
        return;
      }
      if (!wide_block.data()) {
        wide_block = c.scratch(static_cast<std::size_t>(x.numel) * sizeof(float));
        wide = c.view(wide_block, x.numel, DType::kFloat32);
      }
      c.convert(v, wide);
      c.axpby(a, wide, 1.0, diff);
    };
    add(options_.self_weight - 2.0, weight_);
    for (std::size_t k = 0; k < replicas_.size(); ++k) {
      add(options_.sources[k].weight, replicas_[k]);
    }
  }

  TensorView weight_;
  std::vector<TensorView> replicas_;
  LowPrecisionNeighborOptions options_;
  std::vector<int> source_ranks_;  // options_.sources' ranks
  NeighborSequence sequence_;
  bool pattern_agreed_ = false;
};

}  // namespace bagua
