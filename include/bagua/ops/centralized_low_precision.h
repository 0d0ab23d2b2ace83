// C_LP_S: centralized, low precision, synchronous (ByteGrad's primitive).
//
// Every rank ends with (approximately) the sum or average of the bucket over
// all ranks, moving about a quarter of C_FP_S's bytes for fp32. The paper's
// scatter-reduce, over a copy of the bucket padded to n equal chunks:
//   1. compress each of the n chunks (each with its own min and max);
//   2. alltoall: rank r receives the n compressed copies of chunk r;
//   3. decompress and reduce them (in fp32), divide by n when averaging;
//   4. compress the reduced chunk; allgather it;
//   5. decompress all n chunks into the bucket.
// Hierarchical: a full-precision reduce to the node leader, the above among
// the leaders, a broadcast inside the node.
//
// Error feedback (optional): the worker keeps what compression lost from its
// input, e_w = v - Q^-1(Q(v)), and adds it to the next input; the server side
// does the same for the reduced chunk. Over T steps the errors telescope, so
// the sum of the outputs drifts from the exact sum by one step's error, not
// T steps'. (This is the paper's error feedback with the residuals' sign
// chosen so that they are added back; see docs/compression.md.)
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct CentralizedLowPrecisionOptions {
  bool hierarchical = false;
  bool average = true;
  bool error_feedback = false;
};

class CentralizedLowPrecisionOp final : public CommOp {
 public:
  CentralizedLowPrecisionOp(std::shared_ptr<Communicator> global,
                            std::shared_ptr<HierarchicalComms> hierarchy, DType dtype,
                            CentralizedLowPrecisionOptions options)
      : global_(std::move(global)), hierarchy_(std::move(hierarchy)), options_(options) {
    BAGUA_CHECK_ARG(global_ != nullptr, "C_LP_S: no communicator");
    BAGUA_CHECK_ARG(!options_.hierarchical || hierarchy_ != nullptr,
                    "C_LP_S: hierarchical mode needs the intra/inter-node communicators");
    check_compressible(dtype, "C_LP_S (append_centralized_synchronous_op)");
  }

  std::string_view name() const override { return "centralized_low_precision"; }

  void execute(Bucket& bucket) override {
    const ByteMeter meter(*this, {global_.get(), hierarchy_ ? hierarchy_->intra.get() : nullptr,
                                  hierarchy_ ? hierarchy_->inter.get() : nullptr});
    if (!compute_ || compute_->device() != bucket.device()) compute_ = compute_for(bucket.device());
    Compute& c = *compute_;
    bucket.with_flat_view([&](const TensorView& data) {
      if (data.numel == 0) return;
      if (!options_.hierarchical) {
        scatter_reduce(c, *global_, data, options_.average);
        return;
      }
      auto& intra = *hierarchy_->intra;
      intra.reduce(data, data, 0, ReduceOp::kSum);
      if (hierarchy_->is_leader()) scatter_reduce(c, *hierarchy_->inter, data, false);
      intra.broadcast(data, 0);
      if (options_.average) c.divide(data, global_->size());
    });
  }

 private:
  // Written once for host and device: every step is a Compute call (loops on
  // the host, kernels on the communication stream on a GPU), so on a GPU the
  // tensors are compressed before they reach the communicator and only the
  // compressed bytes are staged or sent.
  void scatter_reduce(Compute& c, Communicator& comm, const TensorView& data, bool average) {
    namespace q = minmax_uint8;
    const std::int64_t n = comm.size();
    const std::int64_t chunk = (data.numel + n - 1) / n;
    const std::size_t chunk_bytes = q::compressed_bytes(chunk);
    const std::size_t all_bytes = chunk_bytes * static_cast<std::size_t>(n);

    // fp32 working copy, padded with zeros to n * chunk.
    const auto work_block = c.scratch(static_cast<std::size_t>(chunk * n) * sizeof(float));
    const TensorView work = c.view(work_block, chunk * n, DType::kFloat32);
    c.convert(data, work.slice(0, data.numel));
    c.zero(work.slice(data.numel, chunk * n - data.numel).data,
           static_cast<std::size_t>(chunk * n - data.numel) * sizeof(float));
    if (options_.error_feedback) add_residual(c, worker_error_, work);

    const auto outgoing = c.scratch(all_bytes);
    const auto incoming = c.scratch(all_bytes);
    c.compress(work, chunk, bytes_of(outgoing));
    if (options_.error_feedback) {
      keep_residual(c, worker_error_, work, [&](const TensorView& decoded) {
        c.decompress(bytes_of(outgoing), chunk, decoded, false);
      });
    }
    comm.alltoall(byte_view(c, outgoing, all_bytes), byte_view(c, incoming, all_bytes));

    const auto reduced_block = c.scratch(static_cast<std::size_t>(chunk) * sizeof(float));
    const TensorView reduced = c.view(reduced_block, chunk, DType::kFloat32);
    c.zero(reduced.data, reduced.nbytes());
    for (std::int64_t j = 0; j < n; ++j) {
      c.decompress(bytes_of(incoming) + static_cast<std::size_t>(j) * chunk_bytes, chunk, reduced,
                   true);
    }
    if (average) c.divide(reduced, n);
    if (options_.error_feedback) add_residual(c, server_error_, reduced);

    const auto mine = c.scratch(chunk_bytes);
    c.compress(reduced, chunk, bytes_of(mine));
    if (options_.error_feedback) {
      keep_residual(c, server_error_, reduced, [&](const TensorView& decoded) {
        c.decompress(bytes_of(mine), chunk, decoded, false);
      });
    }
    comm.allgather(byte_view(c, mine, chunk_bytes), byte_view(c, incoming, all_bytes));

    c.decompress(bytes_of(incoming), chunk, work, false);
    c.convert(work.slice(0, data.numel), data);
  }

  static std::byte* bytes_of(const CachingAllocator::Block& block) {
    return static_cast<std::byte*>(block.data());
  }
  static TensorView byte_view(const Compute& c, const CachingAllocator::Block& block,
                              std::size_t bytes) {
    return c.view(block, static_cast<std::int64_t>(bytes), DType::kUInt8);
  }

  // A residual kept across steps, on the bucket's device.
  struct Residual {
    CachingAllocator::Block block;
    std::int64_t numel = 0;
    TensorView view(const Compute& c) const { return c.view(block, numel, DType::kFloat32); }
  };

  // values += residual (a residual of another size, e.g. after re-bucketing,
  // is dropped and restarts at zero).
  static void add_residual(Compute& c, Residual& residual, const TensorView& values) {
    if (residual.numel != values.numel || residual.block.data() == nullptr) {
      residual.block = c.scratch(values.nbytes());
      residual.numel = values.numel;
      c.zero(residual.block.data(), values.nbytes());
      return;
    }
    c.axpby(1.0, residual.view(c), 1.0, values);
  }

  // residual = values - decode(encode(values)), `decode` filling its argument.
  template <typename DecodeFn>
  static void keep_residual(Compute& c, Residual& residual, const TensorView& values,
                            DecodeFn&& decode) {
    const TensorView r = residual.view(c);
    decode(r);
    c.axpby(1.0, values, -1.0, r);
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  CentralizedLowPrecisionOptions options_;
  std::unique_ptr<Compute> compute_;
  Residual worker_error_;
  Residual server_error_;
};

}  // namespace bagua
