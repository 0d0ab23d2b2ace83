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
#include "bagua/compression/compressor.h"
#include "bagua/ops/comm_op.h"
#include "bagua/runtime/bucket.h"

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
    bucket.with_flat_view([&](const TensorView& data) {
      if (!options_.hierarchical) {
        scatter_reduce(*global_, data, options_.average);
        return;
      }
      auto& intra = *hierarchy_->intra;
      intra.reduce(data, data, 0, ReduceOp::kSum);
      if (hierarchy_->is_leader()) scatter_reduce(*hierarchy_->inter, data, false);
      intra.broadcast(data, 0);
      if (options_.average) divide_inplace(data, global_->size());
    });
  }

 private:
  void scatter_reduce(Communicator& comm, const TensorView& data, bool average) {
    namespace q = minmax_uint8;
    const std::int64_t n = comm.size();
    const std::int64_t chunk = (data.numel + n - 1) / n;
    const std::size_t chunk_bytes = q::compressed_bytes(chunk);

    // fp32 working copy, padded with zeros to n * chunk.
    work_.assign(static_cast<std::size_t>(chunk * n), 0.0f);
    TensorView work{work_.data(), chunk * n, DType::kFloat32, data.device};
    dispatch_dtype(data.dtype, [&](auto tag) {
      using T = decltype(tag);
      for (std::int64_t i = 0; i < data.numel; ++i) {
        work_[static_cast<std::size_t>(i)] = static_cast<float>(load(data.data_as<T>()[i]));
      }
    });
    if (options_.error_feedback) add_residual(worker_error_, work_);

    outgoing_.resize(chunk_bytes * static_cast<std::size_t>(n));
    incoming_.resize(outgoing_.size());
    for (std::int64_t j = 0; j < n; ++j) {
      q::compress_view(work.slice(j * chunk, chunk), outgoing_.data() + j * chunk_bytes);
    }
    if (options_.error_feedback) {
      keep_residual(worker_error_, work_, [&](std::vector<float>& decoded) {
        for (std::int64_t j = 0; j < n; ++j) {
          q::decompress_view(outgoing_.data() + j * chunk_bytes,
                             TensorView{decoded.data() + j * chunk, chunk, DType::kFloat32, {}},
                             false);
        }
      });
    }
    comm.alltoall(bytes_view(outgoing_), bytes_view(incoming_));

    reduced_.assign(static_cast<std::size_t>(chunk), 0.0f);
    TensorView mine{reduced_.data(), chunk, DType::kFloat32, data.device};
    for (std::int64_t j = 0; j < n; ++j) {
      q::decompress_view(incoming_.data() + j * chunk_bytes, mine, true);
    }
    if (average) divide_inplace(mine, n);
    if (options_.error_feedback) add_residual(server_error_, reduced_);

    compressed_mine_.resize(chunk_bytes);
    q::compress_view(mine, compressed_mine_.data());
    if (options_.error_feedback) {
      keep_residual(server_error_, reduced_, [&](std::vector<float>& decoded) {
        q::decompress_view(compressed_mine_.data(),
                           TensorView{decoded.data(), chunk, DType::kFloat32, {}}, false);
      });
    }
    comm.allgather(bytes_view(compressed_mine_), bytes_view(incoming_));

    for (std::int64_t j = 0; j < n; ++j) {
      q::decompress_view(incoming_.data() + j * chunk_bytes, work.slice(j * chunk, chunk), false);
    }
    dispatch_dtype(data.dtype, [&](auto tag) {
      using T = decltype(tag);
      for (std::int64_t i = 0; i < data.numel; ++i) {
        data.data_as<T>()[i] =
            store<T>(static_cast<compute_type_t<T>>(work_[static_cast<std::size_t>(i)]));
      }
    });
  }

  static TensorView bytes_view(std::vector<std::byte>& buffer) {
    return TensorView{buffer.data(), static_cast<std::int64_t>(buffer.size()), DType::kUInt8, {}};
  }

  // values += residual (a residual of another size, e.g. after re-bucketing,
  // is dropped).
  static void add_residual(std::vector<float>& residual, std::vector<float>& values) {
    if (residual.size() != values.size()) {
      residual.assign(values.size(), 0.0f);
      return;
    }
    for (std::size_t i = 0; i < values.size(); ++i) values[i] += residual[i];
  }

  // residual = values - decode(encode(values)), decode filling its argument.
  template <typename DecodeFn>
  static void keep_residual(std::vector<float>& residual, const std::vector<float>& values,
                            DecodeFn&& decode) {
    residual.resize(values.size());
    decode(residual);
    for (std::size_t i = 0; i < values.size(); ++i) residual[i] = values[i] - residual[i];
  }

  std::shared_ptr<Communicator> global_;
  std::shared_ptr<HierarchicalComms> hierarchy_;
  CentralizedLowPrecisionOptions options_;
  std::vector<float> work_;
  std::vector<float> reduced_;
  std::vector<float> worker_error_;
  std::vector<float> server_error_;
  std::vector<std::byte> outgoing_;
  std::vector<std::byte> incoming_;
  std::vector<std::byte> compressed_mine_;
};

}  // namespace bagua
