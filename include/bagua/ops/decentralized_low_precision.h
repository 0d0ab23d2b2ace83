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

#include <memory>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/compression/compressor.h"
#include "bagua/ops/comm_op.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

struct LowPrecisionDecentralizedOptions {
  bool hierarchical = true;
};

class LowPrecisionDecentralizedOp final : public CommOp {
 public:
  static constexpr std::int64_t kChunkElements = 1 << 16;

  LowPrecisionDecentralizedOp(std::shared_ptr<Communicator> global,
                              std::shared_ptr<HierarchicalComms> hierarchy, TensorView weight,
                              TensorView left, TensorView right, std::int64_t bucket_numel,
                              DType bucket_dtype, LowPrecisionDecentralizedOptions options)
      : global_(std::move(global)),
        hierarchy_(std::move(hierarchy)),
        weight_(weight),
        left_(left),
        right_(right),
        options_(options) {
    BAGUA_CHECK_ARG(global_ != nullptr, "D_LP_S: no communicator");
    BAGUA_CHECK_ARG(!options_.hierarchical || hierarchy_ != nullptr,
                    "D_LP_S: hierarchical mode needs the intra/inter-node communicators");
    check_compressible(bucket_dtype, "D_LP_S (append_low_precision_decentralized_synchronous_op)");
    for (const auto* view : {&weight_, &left_, &right_}) {
      BAGUA_CHECK_ARG(view->numel == bucket_numel && view->dtype == bucket_dtype,
                      "D_LP_S: weight/left/right copies must match the bucket ({}[{}]), got {}",
                      to_string(bucket_dtype), bucket_numel, view->describe());
    }
  }

  std::string_view name() const override { return "low_precision_decentralized"; }

  void execute(Bucket& bucket) override {
    const ByteMeter meter(*this, {global_.get(), hierarchy_ ? hierarchy_->intra.get() : nullptr,
                                  hierarchy_ ? hierarchy_->inter.get() : nullptr});
    bucket.with_flat_view([&](const TensorView& x) {
      if (!options_.hierarchical) {
        ring_step(*global_, x);
        return;
      }
      auto& intra = *hierarchy_->intra;
      intra.allreduce(x, x, ReduceOp::kAvg);
      if (hierarchy_->is_leader()) ring_step(*hierarchy_->inter, x);
      intra.broadcast(x, 0);
      std::memcpy(weight_.data, x.data, x.nbytes());
    });
  }

 private:
  void ring_step(Communicator& comm, const TensorView& x) {
    namespace q = minmax_uint8;
    const std::int64_t numel = x.numel;
    const q::ChunkedLayout layout{numel, kChunkElements};
    diff_.resize(static_cast<std::size_t>(numel));
    dispatch_dtype(x.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* xs = x.data_as<T>();
      const T* w = weight_.data_as<T>();
      const T* l = left_.data_as<T>();
      const T* r = right_.data_as<T>();
      for (std::int64_t i = 0; i < numel; ++i) {
        const float lf = static_cast<float>(load(l[i]));
        const float rf = static_cast<float>(load(r[i]));
        const float wf = static_cast<float>(load(w[i]));
        diff_[static_cast<std::size_t>(i)] =
            static_cast<float>(load(xs[i])) + lf / 3.0f + rf / 3.0f - 5.0f * wf / 3.0f;
      }
    });
    mine_.resize(layout.bytes());
    q::compress_chunked(TensorView{diff_.data(), numel, DType::kFloat32, {}}, layout, mine_.data());

    from_left_.resize(layout.bytes());
    from_right_.resize(layout.bytes());
    const int n = comm.size();
    if (n == 1) {  // both neighbours are this rank
      from_left_ = mine_;
      from_right_ = mine_;
    } else {
      const int left = (comm.rank() + n - 1) % n;
      const int right = (comm.rank() + 1) % n;
      const TensorView mine = bytes_view(mine_);
      const PeerMessage sends[] = {{mine, left}, {mine, right}};
      // With two ranks left == right: messages to one peer match in order, and
      // both carry the same bytes.
      const PeerMessage receives[] = {{bytes_view(from_left_), left},
                                      {bytes_view(from_right_), right}};
      comm.send_recv(sends, receives);
    }
    q::decompress_chunked(from_left_.data(), layout, left_, true);
    q::decompress_chunked(from_right_.data(), layout, right_, true);
    // x = W + Q^-1(Q(d)); W = x: decode into W in place, then copy to x.
    q::decompress_chunked(mine_.data(), layout, weight_, true);
    std::memcpy(x.data, weight_.data, x.nbytes());
  }

  static TensorView bytes_view(std::vector<std::byte>& buffer) {
    return TensorView{buffer.data(), static_cast<std::int64_t>(buffer.size()), DType::kUInt8, {}};
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  TensorView weight_;
  TensorView left_;
  TensorView right_;
  LowPrecisionDecentralizedOptions options_;
  std::vector<float> diff_;
  std::vector<std::byte> mine_;
  std::vector<std::byte> from_left_;
  std::vector<std::byte> from_right_;
};

}  // namespace bagua
