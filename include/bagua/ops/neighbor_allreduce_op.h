// NeighborAllreduceOp: BlueFog's neighbour allreduce (neighbor_allreduce.h)
// as a bucket op, so bucketed decentralized training runs over any graph or
// dynamic schedule (DecentralizedAlgorithm(topology=...)).
//
// As D_FP_S, each execution combines this rank's weights x (the bucket) with
// its sources' into a separate buffer, `peer_weight`, leaving x untouched
// (forward and backward still read x); `copy_back_peer_weight` then writes
// the result into x. The pattern (sources and their weights, self weight,
// destinations) may change every step: the training thread sets it with
// set_pattern before it marks the bucket's tensors ready, and each execution
// uses the pattern set last.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/neighbor_allreduce.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

class NeighborAllreduceOp final : public HierarchicalOp {
 public:
  NeighborAllreduceOp(std::shared_ptr<Communicator> comm, TensorView peer_weight,
                      std::int64_t bucket_numel, DType bucket_dtype)
      : HierarchicalOp("neighbor_allreduce", comm, nullptr, false),
        neighbor_(std::move(comm)),
        peer_weight_(peer_weight) {
    BAGUA_CHECK_ARG(is_floating_point(bucket_dtype),
                    "neighbor_allreduce op averages floating point weights, got {}",
                    to_string(bucket_dtype));
    BAGUA_CHECK_ARG(peer_weight_.numel == bucket_numel && peer_weight_.dtype == bucket_dtype,
                    "neighbor_allreduce op: peer_weight must match the bucket ({}[{}]), got {}",
                    to_string(bucket_dtype), bucket_numel, peer_weight_.describe());
  }

  std::string_view name() const override { return "neighbor_allreduce"; }

  // The pattern of the next executions. Its ranks are checked against the
  // communicator when an execution runs (an error there names the rank and
  // the bucket's call).
  void set_pattern(NeighborAllreduceOptions options) {
    const std::lock_guard lock(mutex_);
    pattern_ = std::move(options);
  }

  void execute(Bucket& bucket) override {
    BAGUA_CHECK_ARG(peer_weight_.device == bucket.device(),
                    "neighbor_allreduce op: peer_weight is on {} but bucket '{}' is on {}",
                    peer_weight_.device.str(), bucket.name(), bucket.device().str());
    NeighborAllreduceOptions pattern;
    {
      const std::lock_guard lock(mutex_);
      pattern = pattern_;
    }
    pattern.name = bucket.name();  // tags and errors name the bucket
    for_flat_bucket(bucket, [&](const TensorView& x) { neighbor_.run(x, peer_weight_, pattern); });
  }

  // x = peer_weight: adopts the result of the last execution (called from
  // the training thread once the bucket's ops are done).
  void copy_back_peer_weight(Bucket& bucket) {
    Compute& c = compute_on(bucket.device());
    bucket.with_flat_view([&](const TensorView& x) {
      c.copy(x.data, peer_weight_.data, x.nbytes());
      c.finish("copy_back_peer_weight", global().timeout());
    });
  }

 private:
  NeighborAllreduce neighbor_;
  TensorView peer_weight_;
  std::mutex mutex_;
  NeighborAllreduceOptions pattern_;  // guarded by mutex_
};

}  // namespace bagua
