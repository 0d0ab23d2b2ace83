// D_LP_S: decentralized, low precision, synchronous (ring).
//
// Each rank keeps three copies, all of the bucket's size and dtype:
// W (its own weights as its peers know them), L and R (its left and right
// ring neighbours' weights as it knows them). Run after the optimizer step,
// with x the bucket (the freshly updated weights):
//   d = x + L/3 + R/3 - 5W/3       (= (W + L + R)/3 - lr * g - W)
//   send Q(d) to both neighbours, receive theirs;
//   L += Q^-1(d_left);  R += Q^-1(d_right);  x = W + Q^-1(Q(d));  W = x.
// Every rank applies the same decoded bytes, so rank r's W stays equal, bit
// for bit, to the R of rank r-1 and the L of rank r+1.
// Q compresses in chunks of kChunkElements, each with its own min and max.
// Hierarchical: the node first averages x in full precision; the leaders run
// the ring step among themselves; the result is broadcast inside the node
// and every rank sets W = x (L and R are only used on leaders).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "bagua/comm/communicator.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/op_steps.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct LowPrecisionDecentralizedOptions {
  bool hierarchical = true;
};

class LowPrecisionDecentralizedOp final : public HierarchicalOp {
 public:
  static constexpr std::int64_t kChunkElements = 1 << 16;

  LowPrecisionDecentralizedOp(std::shared_ptr<Communicator> global,
                              std::shared_ptr<HierarchicalComms> hierarchy, TensorView weight,
                              TensorView left, TensorView right, std::int64_t bucket_numel,
                              DType bucket_dtype, LowPrecisionDecentralizedOptions options)
      : HierarchicalOp("D_LP_S", std::move(global), std::move(hierarchy), options.hierarchical),
        weight_(weight),
        left_(left),
        right_(right) {
    check_compressible(bucket_dtype, "D_LP_S (append_low_precision_decentralized_synchronous_op)");
    for (const auto* view : {&weight_, &left_, &right_}) {
      BAGUA_CHECK_ARG(view->numel == bucket_numel && view->dtype == bucket_dtype,
                      "D_LP_S: weight/left/right copies must match the bucket ({}[{}]), got {}",
                      to_string(bucket_dtype), bucket_numel, view->describe());
    }
  }

  std::string_view name() const override { return "low_precision_decentralized"; }

  void execute(Bucket& bucket) override {
    for (const auto* view : {&weight_, &left_, &right_}) {
      BAGUA_CHECK_ARG(view->device == bucket.device(),
                      "D_LP_S: the weight copies must be on the bucket's device ({}), got {}",
                      bucket.device().str(), view->describe());
    }
    for_flat_bucket(bucket, [&](const TensorView& x) {
      exchange_across(x, [&](Communicator& comm) { ring_step(comm, x); });
      // Hierarchical: every rank of the node adopts the leader's result.
      if (hierarchical()) compute().copy(weight_.data, x.data, x.nbytes());
    });
  }

 private:
  // Host loops or kernels (Compute), compressing before the bytes reach the
  // communicator.
  void ring_step(Communicator& comm, const TensorView& x) {
    Compute& c = compute();
    const std::int64_t numel = x.numel;
    const std::size_t bytes = minmax_uint8::ChunkedLayout{numel, kChunkElements}.bytes();
    const auto diff_block = c.scratch(static_cast<std::size_t>(numel) * sizeof(float));
    const TensorView diff = c.view(diff_block, numel, DType::kFloat32);
    apply_low_precision_ring_diff(c, x, weight_, left_, right_, diff);
    const auto mine = c.scratch(bytes);
    const auto from_left = c.scratch(bytes);
    const auto from_right = c.scratch(bytes);
    c.compress(diff, kChunkElements, bytes_of(mine));
    const int n = comm.size();
    if (n == 1) {  // both neighbours are this rank
      c.copy(from_left.data(), mine.data(), bytes);
      c.copy(from_right.data(), mine.data(), bytes);
    } else {
      const int left = (comm.rank() + n - 1) % n;
      const int right = (comm.rank() + 1) % n;
      const TensorView mine_view = byte_view(c, mine, bytes);
      const PeerMessage sends[] = {{mine_view, left}, {mine_view, right}};
      // With two ranks left == right: messages to one peer match in order, and
      // both carry the same bytes.
      const PeerMessage receives[] = {{byte_view(c, from_left, bytes), left},
                                      {byte_view(c, from_right, bytes), right}};
      comm.send_recv(sends, receives);
    }
    c.decompress(bytes_of(from_left), kChunkElements, left_, true);
    c.decompress(bytes_of(from_right), kChunkElements, right_, true);
    // x = W + Q^-1(Q(d)); W = x: decode into W in place, then copy to x.
    c.decompress(bytes_of(mine), kChunkElements, weight_, true);
    c.copy(x.data, weight_.data, x.nbytes());
  }

  TensorView weight_;
  TensorView left_;
  TensorView right_;
};

}  // namespace bagua
