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
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "bagua/comm/communicator.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/low_precision_exchange.h"
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
      exchange_across(x, [&](Communicator& comm) { ring_step(comm, x, bucket.name()); });
      // Hierarchical: every rank of the node adopts the leader's result.
      if (hierarchical()) compute().copy(weight_.data, x.data, x.nbytes());
    });
  }

 private:
  // Host loops or kernels (Compute), compressing before the bytes reach the
  // communicator.
  void ring_step(Communicator& comm, const TensorView& x, const std::string& bucket_name) {
    Compute& c = compute();
    const auto diff_block = c.scratch(static_cast<std::size_t>(x.numel) * sizeof(float));
    const TensorView diff = c.view(diff_block, x.numel, DType::kFloat32);
    apply_low_precision_ring_diff(c, x, weight_, left_, right_, diff);
    // With one rank both neighbours are this rank; with two, both are the
    // same peer; with two or three, the neighbours are all the other ranks
    // and one allgather carries the messages (low_precision_exchange.h).
    const int n = comm.size();
    const int neighbours[] = {(comm.rank() + n - 1) % n, (comm.rank() + 1) % n};
    const TensorView replicas[] = {left_, right_};
    const std::string where =
        fmt::format("D_LP_S on bucket '{}' (rank {} of {})", bucket_name, comm.rank(), n);
    exchange_low_precision_difference(c, comm,
                                      {.chunk_elements = kChunkElements,
                                       .sources = neighbours,
                                       .replicas = replicas,
                                       .destinations = neighbours,
                                       .everyone_neighbours_everyone = n <= 3,
                                       .where = where},
                                      diff, weight_, x);
  }

  TensorView weight_;
  TensorView left_;
  TensorView right_;
};

}  // namespace bagua
