// HierarchicalOp: the skeleton shared by the bucket ops that communicate on
// a global communicator or, hierarchically, inside the node and among the
// node leaders (C_FP_S, C_LP_S, D_FP_S, D_LP_S). It holds the communicators
// and checks them, counts the bytes they send, keeps a Compute on the
// bucket's device, and writes the two hierarchical patterns once:
// - centralized (reduce_across): the node sums (every member, so the sum
//   runs through shared memory), each rank reduces its share of the sum with
//   the same share on the other nodes (or, with nodes of unequal size, the
//   leaders reduce it all), the node gathers the result, then divides;
// - decentralized (exchange_across): the node averages on every rank, the
//   leaders exchange among themselves, the node receives the leader's result.
//
// Threading: as CommOp (the communication thread, one op at a time).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/core/timeline.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/compute.h"

namespace bagua {

class HierarchicalOp : public CommOp {
 public:
  void abort_communication() noexcept override {
    global_->abort();
    if (hierarchy_ && hierarchy_->intra) hierarchy_->intra->abort();
    if (hierarchy_ && hierarchy_->inter) hierarchy_->inter->abort();
    if (hierarchy_ && hierarchy_->across) hierarchy_->across->abort();
  }

 protected:
  // `label` names the op in errors ("C_FP_S"); `hierarchy` is required when
  // `hierarchical` is set.
  HierarchicalOp(std::string_view label, std::shared_ptr<Communicator> global,
                 std::shared_ptr<HierarchicalComms> hierarchy, bool hierarchical)
      : global_(std::move(global)), hierarchy_(std::move(hierarchy)), hierarchical_(hierarchical) {
    BAGUA_CHECK_ARG(global_ != nullptr, "{}: no communicator", label);
    BAGUA_CHECK_ARG(!hierarchical_ || hierarchy_ != nullptr,
                    "{}: hierarchical mode needs the intra/inter-node communicators", label);
  }

  // fn(data) over the bucket's elements as one flat view, counting what the
  // communicators send, with compute() on the bucket's device.
  template <typename Fn>
  void for_flat_bucket(Bucket& bucket, Fn&& fn) {
    const ByteMeter meter(*this, {global_.get(), hierarchy_ ? hierarchy_->intra.get() : nullptr,
                                  hierarchy_ ? hierarchy_->inter.get() : nullptr,
                                  hierarchy_ ? hierarchy_->across.get() : nullptr});
    compute_on(bucket.device());
    bucket.with_flat_view(std::forward<Fn>(fn));
  }

  // data = the sum over all ranks, divided by their number when `average`.
  // Flat: reduce(global, data, average). Hierarchical: the node sums, the
  // leaders run reduce(inter, data, false), the node receives the leader's
  // sum and divides it.
  // The node's sum is an allreduce, not a reduce to the leader: inside a
  // node it runs through shared memory, which has no reduce, and costs there
  // less than a reduce over loopback TCP. With nodes of equal size every
  // rank then reduces its own share of the node's sum with the same share
  // on the other nodes (reduce(across, share, false)), and the node gathers
  // the shares: a node still sends its bytes once, but from all its ranks
  // at once, which keeps the link busy while each rank's stream waits. Else,
  // or when the op keeps state per rank of what it reduces (`shares` false:
  // C_LP_S's residuals), the leaders reduce the whole sum and broadcast it
  // inside the node.
  template <typename Reduce>
  void reduce_across(const TensorView& data, bool average, Reduce&& reduce, bool shares = true) {
    if (!hierarchical_) {
      reduce(*global_, data, average);
      return;
    }
    auto& intra = *hierarchy_->intra;
    {
      const TimelinePhase phase("hierarchical.node_sum");
      intra.allreduce(data, data, ReduceOp::kSum);
    }
    if (shares && hierarchy_->across) {
      reduce_shares(data, reduce);
    } else {
      if (hierarchy_->is_leader()) {
        const TimelinePhase phase("hierarchical.across_nodes");
        reduce(*hierarchy_->inter, data, false);
      }
      const TimelinePhase phase("hierarchical.node_broadcast");
      intra.broadcast(data, 0);
    }
    if (average) compute_->divide(data, global_->size());
  }

  // data (the node's sum on every rank of the node) = the sum over nodes:
  // this rank's share reduced across nodes, then every share gathered.
  template <typename Reduce>
  void reduce_shares(const TensorView& data, Reduce& reduce) {
    auto& intra = *hierarchy_->intra;
    const std::int64_t ranks = intra.size();
    const std::int64_t share = (data.numel + ranks - 1) / ranks;
    const std::int64_t begin = std::min(data.numel, share * intra.rank());
    const std::int64_t count = std::min(share, data.numel - begin);
    if (count > 0) {
      const TimelinePhase phase("hierarchical.across_nodes");
      reduce(*hierarchy_->across, data.slice(begin, count), false);
    }
    const TimelinePhase phase("hierarchical.node_gather");
    if (share * ranks == data.numel) {
      // In place: this rank's share already sits where the gather puts it.
      intra.allgather(data.slice(begin, count), data);
      return;
    }
    // Shares of equal size for the gather; the last one padded, the padding
    // never read.
    Compute& c = *compute_;
    const std::size_t element = dtype_size(data.dtype);
    const auto mine_block = c.scratch(static_cast<std::size_t>(share) * element);
    const TensorView mine = c.view(mine_block, share, data.dtype);
    if (count > 0) c.copy(mine.data, data.slice(begin, count).data, static_cast<std::size_t>(count) * element);
    const auto all_block = c.scratch(static_cast<std::size_t>(share * ranks) * element);
    const TensorView all = c.view(all_block, share * ranks, data.dtype);
    intra.allgather(mine, all);
    c.copy(data.data, all.data, data.nbytes());
  }

  // Flat: exchange(global). Hierarchical: the node averages `data` on every
  // rank, the leaders run exchange(inter), the node receives the leader's
  // `data`.
  template <typename Exchange>
  void exchange_across(const TensorView& data, Exchange&& exchange) {
    if (!hierarchical_) {
      exchange(*global_);
      return;
    }
    auto& intra = *hierarchy_->intra;
    intra.allreduce(data, data, ReduceOp::kAvg);
    if (hierarchy_->is_leader()) exchange(*hierarchy_->inter);
    intra.broadcast(data, 0);
  }

  // Whether an op whose hierarchical form computes the same sum as its flat
  // one (C_FP_S, C_HP_S) should run it: not over a hierarchy of one level
  // (one node, or one rank per node), where it is the flat sum with two more
  // passes.
  static bool worth_two_levels(bool hierarchical, const std::shared_ptr<HierarchicalComms>& h) {
    return hierarchical && !(h && h->single_level());
  }

  // The compute of `device` (made again when the bucket moved).
  Compute& compute_on(Device device) {
    if (!compute_ || compute_->device() != device) compute_ = compute_for(device);
    return *compute_;
  }
  Compute& compute() { return *compute_; }
  Communicator& global() const { return *global_; }
  bool hierarchical() const { return hierarchical_; }

  // A scratch block as bytes, and as a uint8 view of its first `bytes`.
  static std::byte* bytes_of(const CachingAllocator::Block& block) {
    return static_cast<std::byte*>(block.data());
  }
  static TensorView byte_view(const Compute& c, const CachingAllocator::Block& block,
                              std::size_t bytes) {
    return c.view(block, static_cast<std::int64_t>(bytes), DType::kUInt8);
  }

 private:
  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  bool hierarchical_;
  std::unique_ptr<Compute> compute_;
};

}  // namespace bagua
