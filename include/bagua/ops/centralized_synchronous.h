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
#include "bagua/core/elementwise.h"
#include "bagua/ops/comm_op.h"
#include "bagua/runtime/bucket.h"

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
    bucket.with_flat_view([&](const TensorView& data) {
      if (!options_.hierarchical) {
        reduce_on(*global_, data, options_.average ? ReduceOp::kAvg : ReduceOp::kSum);
        return;
      }
      auto& intra = *hierarchy_->intra;
      intra.reduce(data, data, 0, ReduceOp::kSum);
      if (hierarchy_->is_leader()) reduce_on(*hierarchy_->inter, data, ReduceOp::kSum);
      intra.broadcast(data, 0);
      if (options_.average) divide_inplace(data, global_->size());
    });
  }

 private:
  // data = op over comm's ranks of data, by allreduce or scatter-gather.
  void reduce_on(Communicator& comm, const TensorView& data, ReduceOp op) {
    if (!options_.scattergather || comm.size() == 1) {
      comm.allreduce(data, data, op);
      return;
    }
    const std::int64_t n = comm.size();
    const std::int64_t chunk = (data.numel + n - 1) / n;
    padded_.assign(static_cast<std::size_t>(chunk * n) * dtype_size(data.dtype), std::byte{0});
    TensorView padded{padded_.data(), chunk * n, data.dtype, data.device};
    if (data.nbytes() > 0) std::memcpy(padded.data, data.data, data.nbytes());
    reduced_.resize(static_cast<std::size_t>(chunk) * dtype_size(data.dtype));
    TensorView mine{reduced_.data(), chunk, data.dtype, data.device};
    comm.reduce_scatter(padded, mine, op);
    comm.allgather(mine, padded);
    if (data.nbytes() > 0) std::memcpy(data.data, padded.data, data.nbytes());
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  CentralizedSynchronousOptions options_;
  std::vector<std::byte> padded_;
  std::vector<std::byte> reduced_;
};

}  // namespace bagua
