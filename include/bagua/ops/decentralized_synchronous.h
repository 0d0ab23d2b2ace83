// D_FP_S: decentralized, full precision, synchronous.
//
// Each execution averages this rank's weights x (the bucket) with its peers'
// into a separate buffer, `peer_weight`, leaving x untouched: the exchange
// runs while forward and backward still read x. `copy_back_peer_weight`
// then writes the average into x (after backward, before the optimizer step).
//   all:       peer_weight = mean over all ranks of x
//   shift_one: peer_weight = (x + x_peer) / 2, partner per peer_selection.h
//              (a rank without partner this step keeps x)
//   ring:      peer_weight = (x + x_left + x_right) / 3; with two ranks the
//              two neighbours are one rank: (x + x_other) / 2
// Hierarchical: x is first averaged inside the node in full precision, the
// leaders exchange among themselves, and the result is broadcast in the node.
// The communication step counts executions, so all ranks agree on it.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/core/compute.h"
#include "bagua/core/cuda_support.h"
#include "bagua/ops/comm_op.h"
#include "bagua/ops/peer_selection.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

struct DecentralizedSynchronousOptions {
  bool hierarchical = true;
  PeerSelection peer_selection = PeerSelection::kAll;
};

class DecentralizedSynchronousOp final : public CommOp {
 public:
  DecentralizedSynchronousOp(std::shared_ptr<Communicator> global,
                             std::shared_ptr<HierarchicalComms> hierarchy, TensorView peer_weight,
                             std::int64_t bucket_numel, DType bucket_dtype,
                             DecentralizedSynchronousOptions options)
      : global_(std::move(global)),
        hierarchy_(std::move(hierarchy)),
        peer_weight_(peer_weight),
        options_(options) {
    BAGUA_CHECK_ARG(global_ != nullptr, "D_FP_S: no communicator");
    BAGUA_CHECK_ARG(!options_.hierarchical || hierarchy_ != nullptr,
                    "D_FP_S: hierarchical mode needs the intra/inter-node communicators");
    BAGUA_CHECK_ARG(is_floating_point(bucket_dtype),
                    "D_FP_S averages floating point weights, got {}", to_string(bucket_dtype));
    BAGUA_CHECK_ARG(peer_weight_.numel == bucket_numel && peer_weight_.dtype == bucket_dtype,
                    "D_FP_S: peer_weight must match the bucket ({}[{}]), got {}",
                    to_string(bucket_dtype), bucket_numel, peer_weight_.describe());
  }

  std::string_view name() const override { return "decentralized_synchronous"; }

  void execute(Bucket& bucket) override {
    const ByteMeter meter(*this, {global_.get(), hierarchy_ ? hierarchy_->intra.get() : nullptr,
                                  hierarchy_ ? hierarchy_->inter.get() : nullptr});
    BAGUA_CHECK_ARG(peer_weight_.device == bucket.device(),
                    "D_FP_S: peer_weight is on {} but bucket '{}' is on {}",
                    peer_weight_.device.str(), bucket.name(), bucket.device().str());
    if (!compute_ || compute_->device() != bucket.device()) compute_ = compute_for(bucket.device());
    bucket.with_flat_view([&](const TensorView& x) {
      compute_->copy(peer_weight_.data, x.data, x.nbytes());
      if (!options_.hierarchical) {
        average_with_peers(*global_, peer_weight_);
      } else {
        auto& intra = *hierarchy_->intra;
        intra.allreduce(peer_weight_, peer_weight_, ReduceOp::kAvg);
        if (hierarchy_->is_leader()) average_with_peers(*hierarchy_->inter, peer_weight_);
        intra.broadcast(peer_weight_, 0);
      }
    });
    ++step_;
  }

  // x = peer_weight: adopts the average computed by the last execution.
  void copy_back_peer_weight(Bucket& bucket) {
    if (!compute_ || compute_->device() != bucket.device()) compute_ = compute_for(bucket.device());
    bucket.with_flat_view([&](const TensorView& x) {
      compute_->copy(x.data, peer_weight_.data, x.nbytes());
      // Called from the training thread: the copy is done when this returns.
      compute_->finish("copy_back_peer_weight", global_->timeout());
    });
  }

  // As copy_back_peer_weight, for a CUDA bucket without a host wait: the copy
  // runs on the communication stream after the work already on `cuda_stream`
  // (the caller's stream, a cudaStream_t; nullptr is the legacy default
  // stream), and `cuda_stream` waits for the copy. The average must be
  // complete (wait_pending_comm_ops returned). A CPU bucket copies on the host.
  void copy_back_peer_weight_on_stream(Bucket& bucket, void* cuda_stream) {
    const Device device = bucket.device();
    if (device.type != DeviceType::kCUDA) return copy_back_peer_weight(bucket);
    if (!compute_ || compute_->device() != device) compute_ = compute_for(device);
    void* communication = cuda_communication_stream(device.index);
    const auto before = cuda_event_pool(device.index).acquire();
    cuda_event_record(before.get(), cuda_stream);
    cuda_stream_wait_event(communication, before.get());
    bucket.with_flat_view(
        [&](const TensorView& x) { compute_->copy(x.data, peer_weight_.data, x.nbytes()); });
    const auto after = cuda_event_pool(device.index).acquire();
    cuda_event_record(after.get(), communication);
    cuda_stream_wait_event(cuda_stream, after.get());
  }

  std::int64_t communication_step() const { return step_; }

 private:
  // w = average of w with the peers of this step, on `comm`'s ranks.
  void average_with_peers(Communicator& comm, const TensorView& w) {
    const int n = comm.size();
    const int rank = comm.rank();
    if (n == 1) return;
    switch (options_.peer_selection) {
      case PeerSelection::kAll: comm.allreduce(w, w, ReduceOp::kAvg); return;
      case PeerSelection::kShiftOne: {
        const int peer = shift_one_peer(rank, n, step_);
        if (peer >= 0) average_with(comm, w, peer);  // else: sits this step out
        return;
      }
      case PeerSelection::kRing: {
        const int left = (rank + n - 1) % n;
        const int right = (rank + 1) % n;
        if (left == right) {  // two ranks: one neighbour
          average_with(comm, w, left);
          return;
        }
        const auto left_block = compute_->scratch(w.nbytes());
        const auto right_block = compute_->scratch(w.nbytes());
        const TensorView from_left = compute_->view(left_block, w.numel, w.dtype);
        const TensorView from_right = compute_->view(right_block, w.numel, w.dtype);
        const PeerMessage sends[] = {{w, left}, {w, right}};
        const PeerMessage receives[] = {{from_left, left}, {from_right, right}};
        comm.send_recv(sends, receives);
        compute_->axpby(1.0, from_left, 1.0, w);
        compute_->axpby(1.0, from_right, 1.0, w);
        compute_->divide(w, 3);
        return;
      }
    }
  }

  // w = (w + w of `peer`) / 2.
  void average_with(Communicator& comm, const TensorView& w, int peer) {
    const auto block = compute_->scratch(w.nbytes());
    const TensorView theirs = compute_->view(block, w.numel, w.dtype);
    const PeerMessage sends[] = {{w, peer}};
    const PeerMessage receives[] = {{theirs, peer}};
    comm.send_recv(sends, receives);
    compute_->axpby(1.0, theirs, 1.0, w);
    compute_->divide(w, 2);
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  TensorView peer_weight_;
  DecentralizedSynchronousOptions options_;
  std::int64_t step_ = 0;
  std::unique_ptr<Compute> compute_;
};

}  // namespace bagua
