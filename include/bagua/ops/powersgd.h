// PowerSGD: the average of a bucket's gradients with low-rank compression
// (Vogels et al., 2019; the scheme of PyTorch DDP's powerSGD_hook). Each
// compressed gradient M (rows x cols) travels as two thin factors:
//   M += error                 (error feedback: what compression lost last step)
//   P = M Q                    (Q: cols x rank, kept from the last step)
//   P = sum over ranks of P    (only its column space matters)
//   P = orthogonalize(P)       (Gram-Schmidt on the columns)
//   Q = average over ranks of M^T P
//   M = P Q^T, error = M_before - M
// The bucket's other tensors (vectors, matrices that would not shrink) are
// averaged uncompressed, riding in the exchange of P: two exchanges per
// bucket. While `compressing` is off (the first steps of training) the whole
// bucket is averaged uncompressed in one allreduce.
//
// With `low_precision` the two exchanges carry MinMaxUInt8 codes (the 8-bit
// average of low_precision_partial_allreduce.h with every rank a member);
// they then average P rather than sum it, which only scales its columns
// before they are normalized. Each tensor is coded apart (a min/max per
// kCodeChunk elements of it), and a bucket without a compressed matrix is
// coded too, so at two ranks how tensors are bucketed does not change the
// bits.
//
// Q and the error of every compressed gradient are state kept across steps;
// they live in memory the caller owns (PyTorch tensors in the Python
// algorithm, so checkpoints save them), given as views at construction.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/ops/low_rank_steps.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

struct PowerSGDOptions {
  std::int64_t rank = 1;
  double orthogonalization_epsilon = 0.0;
  bool low_precision = false;
};

// A bucket tensor sent as factors: its index in the bucket, its shape as a
// matrix, and its state (q: cols x rank; error: rows x cols, or no elements
// without error feedback), of the bucket's dtype and device.
//
// With p_prev (rows x rank) and q_prev (cols x rank) given, on host memory,
// the error is deferred (low_rank_steps.h): `error` then holds M, the
// gradient plus the error of the step before, and the error is that minus
// p_prev q_prev^T, formed when the next step needs it. Without them (no
// elements; device buckets) `error` holds the error itself.
struct LowRankTensor {
  std::int64_t index = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  TensorView q;
  TensorView error;
  TensorView p_prev;
  TensorView q_prev;

  bool deferred() const { return p_prev.numel > 0; }
};

class PowerSGDOp final : public HierarchicalOp {
 public:
  PowerSGDOp(std::shared_ptr<Communicator> comm, const Bucket& bucket,
             std::vector<LowRankTensor> matrices, PowerSGDOptions options);

  std::string_view name() const override { return "powersgd"; }
  void execute(Bucket& bucket) override;

  // Off: the next executions average uncompressed. Set from the training
  // thread between steps.
  void set_compressing(bool on) { compressing_.store(on); }
  bool compressing() const { return compressing_.load(); }

  // Over all executions: what the exchanges were handed (payload bytes per
  // rank: the factors and vectors, in 8-bit codes plus their headers with
  // low_precision), and what plain averaging would have sent.
  std::int64_t exchanged_bytes() const { return exchanged_bytes_.load(); }
  std::int64_t uncompressed_bytes() const { return uncompressed_bytes_.load(); }

 private:
  void average_compressed(Bucket& bucket);
  // The phases of average_compressed (one span each on the timeline).
  void project(Compute& c, const Bucket& bucket, const TensorView& first);
  void scatter_vectors(Compute& c, Bucket& bucket, const TensorView& first, std::int64_t divisor);
  void project_back(Compute& c, const Bucket& bucket, const TensorView& first,
                    const TensorView& qs);
  void reconstruct(Compute& c, Bucket& bucket, const TensorView& first, const TensorView& qs);
  std::int64_t vectors_numel(const Bucket& bucket) const;
  std::int64_t first_numel(const Bucket& bucket) const;
  std::int64_t q_numel() const;
  static CachingAllocator::Block scratch_for(Compute& c, const Bucket& bucket, std::int64_t numel);
  TensorView p_of(const TensorView& first, std::int64_t vectors_end, std::size_t k) const;
  // Sums (full precision) or 8-bit averages `data` over the ranks; returns
  // what to divide by for the average (the rank count, or 1). `segments`:
  // the lengths of the tensors `data` holds back to back (each vector, each
  // matrix's factor), which the 8-bit codes keep apart.
  std::int64_t exchange(const TensorView& data, const std::vector<std::int64_t>& segments);
  void sum_of_two(const TensorView& data);
  std::int64_t average_8bit(const TensorView& data, const std::vector<std::int64_t>& segments);
  std::int64_t average_8bit_of_two(const TensorView& host,
                                   const std::vector<std::int64_t>& segments);
  std::vector<std::int64_t> first_segments(const Bucket& bucket) const;
  std::vector<std::int64_t> q_segments() const;

  // Elements per min/max of the 8-bit codes (at most; a tensor's end also cuts).
  static constexpr std::int64_t kCodeChunk = 1024;
  LowRankShape shape_of(const LowRankTensor& t) const { return {t.rows, t.cols, options_.rank}; }

  std::vector<LowRankTensor> matrices_;
  std::vector<std::int64_t> vectors_;  // indices of the tensors averaged uncompressed
  PowerSGDOptions options_;
  std::atomic<bool> compressing_{false};
  std::atomic<std::int64_t> exchanged_bytes_{0};
  std::atomic<std::int64_t> uncompressed_bytes_{0};
};

}  // namespace bagua
