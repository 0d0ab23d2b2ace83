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

#include <cstdint>
#include <memory>
#include <string_view>

#include "bagua/comm/communicator.h"
#include "bagua/core/cuda.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/peer_selection.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct DecentralizedSynchronousOptions {
  bool hierarchical = true;
  PeerSelection peer_selection = PeerSelection::kAll;
};

class DecentralizedSynchronousOp final : public HierarchicalOp {
 public:
  DecentralizedSynchronousOp(std::shared_ptr<Communicator> global,
                             std::shared_ptr<HierarchicalComms> hierarchy, TensorView peer_weight,
                             std::int64_t bucket_numel, DType bucket_dtype,
                             DecentralizedSynchronousOptions options)
      : HierarchicalOp("D_FP_S", std::move(global), std::move(hierarchy), options.hierarchical),
        peer_weight_(peer_weight),
        options_(options) {
    BAGUA_CHECK_ARG(is_floating_point(bucket_dtype),
                    "D_FP_S averages floating point weights, got {}", to_string(bucket_dtype));
    BAGUA_CHECK_ARG(peer_weight_.numel == bucket_numel && peer_weight_.dtype == bucket_dtype,
                    "D_FP_S: peer_weight must match the bucket ({}[{}]), got {}",
                    to_string(bucket_dtype), bucket_numel, peer_weight_.describe());
  }

  std::string_view name() const override { return "decentralized_synchronous"; }

  void execute(Bucket& bucket) override {
    BAGUA_CHECK_ARG(peer_weight_.device == bucket.device(),
                    "D_FP_S: peer_weight is on {} but bucket '{}' is on {}",
                    peer_weight_.device.str(), bucket.name(), bucket.device().str());
    for_flat_bucket(bucket, [&](const TensorView& x) {
      compute().copy(peer_weight_.data, x.data, x.nbytes());
      exchange_across(peer_weight_,
                      [&](Communicator& comm) { average_with_peers(comm, peer_weight_); });
    });
    ++step_;
  }

  // x = peer_weight: adopts the average computed by the last execution.
  void copy_back_peer_weight(Bucket& bucket) {
    Compute& c = compute_on(bucket.device());
    bucket.with_flat_view([&](const TensorView& x) {
      c.copy(x.data, peer_weight_.data, x.nbytes());
      // Called from the training thread: the copy is done when this returns.
      c.finish("copy_back_peer_weight", global().timeout());
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
    Compute& c = compute_on(device);
    void* communication = cuda_communication_stream(device.index);
    const auto before = cuda_event_pool(device.index).acquire();
    cuda_event_record(before.get(), cuda_stream);
    cuda_stream_wait_event(communication, before.get());
    bucket.with_flat_view(
        [&](const TensorView& x) { c.copy(x.data, peer_weight_.data, x.nbytes()); });
    const auto after = cuda_event_pool(device.index).acquire();
    cuda_event_record(after.get(), communication);
    cuda_stream_wait_event(cuda_stream, after.get());
  }

  std::int64_t communication_step() const { return step_; }

  // Resumes the step count (shift_one's partners depend on it) after a
  // checkpoint or when a re-bucketing replaces the op. Call it only while no
  // execution is pending (the count is not atomic: the communication thread
  // writes it). Negative steps are refused.
  void set_communication_step(std::int64_t step) {
    BAGUA_CHECK_ARG(step >= 0, "D_FP_S: communication_step must be >= 0, got {}", step);
    step_ = step;
  }

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
      case PeerSelection::kRing: average_with_neighbours(comm, w); return;
    }
  }

  // w = (w + w_left + w_right) / 3; with two ranks, (w + w_other) / 2.
  void average_with_neighbours(Communicator& comm, const TensorView& w) {
    const int n = comm.size();
    const int left = (comm.rank() + n - 1) % n;
    const int right = (comm.rank() + 1) % n;
    if (left == right) {  // two ranks: one neighbour
      average_with(comm, w, left);
      return;
    }
    Compute& c = compute();
    const auto left_block = c.scratch(w.nbytes());
    const auto right_block = c.scratch(w.nbytes());
    const TensorView from_left = c.view(left_block, w.numel, w.dtype);
    const TensorView from_right = c.view(right_block, w.numel, w.dtype);
    const PeerMessage sends[] = {{w, left}, {w, right}};
    const PeerMessage receives[] = {{from_left, left}, {from_right, right}};
    comm.send_recv(sends, receives);
    c.axpby(1.0, from_left, 1.0, w);
    c.axpby(1.0, from_right, 1.0, w);
    c.divide(w, 3);
  }

  // w = (w + w of `peer`) / 2.
  void average_with(Communicator& comm, const TensorView& w, int peer) {
    Compute& c = compute();
    const auto block = c.scratch(w.nbytes());
    const TensorView theirs = c.view(block, w.numel, w.dtype);
    const PeerMessage sends[] = {{w, peer}};
    const PeerMessage receives[] = {{theirs, peer}};
    comm.send_recv(sends, receives);
    c.axpby(1.0, theirs, 1.0, w);
    c.divide(w, 2);
  }

  TensorView peer_weight_;
  DecentralizedSynchronousOptions options_;
  std::int64_t step_ = 0;
};

}  // namespace bagua
