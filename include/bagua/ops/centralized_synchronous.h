// C_FP_S: centralized, full precision, synchronous.
//
// Every rank ends with the sum (or average) of the bucket over all ranks.
// - flat: one allreduce.
// - scattergather: reduce_scatter then allgather over a copy padded to a
//   multiple of the world size (the form the compressed variant builds on).
// - hierarchical: reduce to the node leader, allreduce among leaders,
//   broadcast inside the node; intra-node traffic stays on the node.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "bagua/comm/communicator.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct CentralizedSynchronousOptions {
  bool hierarchical = false;
  bool average = true;
  bool scattergather = false;
};

class CentralizedSynchronousOp final : public HierarchicalOp {
 public:
  // `hierarchy` is required when options.hierarchical is set.
  CentralizedSynchronousOp(std::shared_ptr<Communicator> global,
                           std::shared_ptr<HierarchicalComms> hierarchy,
                           CentralizedSynchronousOptions options)
      : HierarchicalOp("C_FP_S", std::move(global), hierarchy,
                       worth_two_levels(options.hierarchical, hierarchy)),
        options_(options) {}

  std::string_view name() const override { return "centralized_synchronous"; }

  void execute(Bucket& bucket) override {
    for_flat_bucket(bucket, [&](const TensorView& data) {
      reduce_across(data, options_.average, [&](Communicator& comm, const TensorView& d, bool avg) {
        reduce_on(comm, d, avg ? ReduceOp::kAvg : ReduceOp::kSum);
      });
    });
  }

 private:
  // data = op over comm's ranks of data, by allreduce or scatter-gather.
  void reduce_on(Communicator& comm, const TensorView& data, ReduceOp op) {
    if (!options_.scattergather || comm.size() == 1) {
      comm.allreduce(data, data, op);
      return;
    }
    Compute& c = compute();
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

  CentralizedSynchronousOptions options_;
};

}  // namespace bagua
