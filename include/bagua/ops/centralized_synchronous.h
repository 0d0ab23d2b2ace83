// C_FP_S: centralized, full precision, synchronous.
//
// Every rank ends with the sum (or average) of the bucket over all ranks.
// - flat: one allreduce.
// - scattergather: reduce_scatter then allgather over a copy padded to a
//   multiple of the world size (the form the compressed variant builds on).
// - hierarchical: reduce to the node leader, allreduce among leaders,
//   broadcast inside the node; intra-node traffic stays on the node.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct CentralizedSynchronousOptions {
  bool hierarchical = false;
  bool average = true;
  bool scattergather = false;
};

class CentralizedSynchronousOp final : public CommOp {
 public:
  // `hierarchy` is required when options.hierarchical is set.
  CentralizedSynchronousOp(std::shared_ptr<Communicator> global,
                           std::shared_ptr<HierarchicalComms> hierarchy,
                           CentralizedSynchronousOptions options)
      : global_(std::move(global)), hierarchy_(std::move(hierarchy)), options_(options) {
    BAGUA_CHECK_ARG(global_ != nullptr, "C_FP_S: no communicator");
    BAGUA_CHECK_ARG(!options_.hierarchical || hierarchy_ != nullptr,
                    "C_FP_S: hierarchical mode needs the intra/inter-node communicators");
  }

  std::string_view name() const override { return "centralized_synchronous"; }

  void execute(Bucket& bucket) override {
    const ByteMeter meter(*this, {global_.get(), hierarchy_ ? hierarchy_->intra.get() : nullptr,
                                  hierarchy_ ? hierarchy_->inter.get() : nullptr});
    if (!compute_ || compute_->device() != bucket.device()) compute_ = compute_for(bucket.device());
    bucket.with_flat_view([&](const TensorView& data) {
      if (!options_.hierarchical) {
        reduce_on(*global_, data, options_.average ? ReduceOp::kAvg : ReduceOp::kSum);
        return;
      }
      auto& intra = *hierarchy_->intra;
      intra.reduce(data, data, 0, ReduceOp::kSum);
      if (hierarchy_->is_leader()) reduce_on(*hierarchy_->inter, data, ReduceOp::kSum);
      intra.broadcast(data, 0);
      if (options_.average) compute_->divide(data, global_->size());
    });
  }

 private:
  // data = op over comm's ranks of data, by allreduce or scatter-gather.
  void reduce_on(Communicator& comm, const TensorView& data, ReduceOp op) {
    if (!options_.scattergather || comm.size() == 1) {
      comm.allreduce(data, data, op);
      return;
    }
    Compute& c = *compute_;
    const std::int64_t n = comm.size();
    const std::int64_t chunk = (data.numel + n - 1) / n;
    const std::size_t element = dtype_size(data.dtype);
    const auto padded_block = c.scratch(static_cast<std::size_t>(chunk * n) * element);
    const TensorView padded = c.view(padded_block, chunk * n, data.dtype);
    c.copy(padded.data, data.data, data.nbytes());
    c.zero(static_cast<std::byte*>(padded.data) + data.nbytes(), padded.nbytes() - data.nbytes());
    const auto mine_block = c.scratch(static_cast<std::size_t>(chunk) * element);
    const TensorView mine = c.view(mine_block, chunk, data.dtype);
    comm.reduce_scatter(padded, mine, op);
    comm.allgather(mine, padded);
    c.copy(data.data, padded.data, data.nbytes());
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  CentralizedSynchronousOptions options_;
  std::unique_ptr<Compute> compute_;
};

}  // namespace bagua
