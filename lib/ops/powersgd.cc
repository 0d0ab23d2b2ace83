// PowerSGDOp (bagua/ops/powersgd.h): one step is project, exchange P,
// orthogonalize, project back, exchange Q, reconstruct, all on the bucket's
// device through its Compute.
#include "bagua/ops/powersgd.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "bagua/compression/chunked_layout.h"
#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/timeline.h"
#include "bagua/ops/low_precision_partial_allreduce.h"

namespace bagua {

PowerSGDOp::PowerSGDOp(std::shared_ptr<Communicator> comm, const Bucket& bucket,
                       std::vector<LowRankTensor> matrices, PowerSGDOptions options)
    : HierarchicalOp("powersgd", std::move(comm), nullptr, false),
      matrices_(std::move(matrices)),
      options_(options) {
  const auto& tensors = bucket.tensors();
  BAGUA_CHECK_ARG(options_.rank >= 1, "powersgd: rank must be at least 1, got {}", options_.rank);
  BAGUA_CHECK_ARG(options_.orthogonalization_epsilon >= 0,
                  "powersgd: orthogonalization_epsilon must be >= 0, got {}",
                  options_.orthogonalization_epsilon);
  BAGUA_CHECK_ARG(is_floating_point(bucket.dtype()), "powersgd: bucket '{}' holds {}, not floats",
                  bucket.name(), to_string(bucket.dtype()));
  std::vector<bool> compressed(tensors.size(), false);
  for (const auto& m : matrices_) {
    BAGUA_CHECK_ARG(
        m.index >= 0 && m.index < static_cast<std::int64_t>(tensors.size()) && !compressed[m.index],
        "powersgd: bucket '{}' has no tensor {} (or it is listed twice)", bucket.name(), m.index);
    const TensorView& grad = tensors[m.index].view;
    BAGUA_CHECK_ARG(m.rows > 0 && m.cols > 0 && m.rows * m.cols == grad.numel,
                    "powersgd: tensor '{}' ({}) is not {} x {}", tensors[m.index].name,
                    grad.describe(), m.rows, m.cols);
    const auto state_fits = [&](const TensorView& v, std::int64_t numel) {
      return v.numel == numel && v.dtype == grad.dtype && v.device == grad.device &&
             v.data != nullptr;
    };
    BAGUA_CHECK_ARG(state_fits(m.q, m.cols * options_.rank),
                    "powersgd: q of '{}' must be {} x {} of {} on {}, got {}",
                    tensors[m.index].name, m.cols, options_.rank, to_string(grad.dtype),
                    grad.device.str(), m.q.describe());
    BAGUA_CHECK_ARG(m.error.numel == 0 || state_fits(m.error, grad.numel),
                    "powersgd: error of '{}' must be {} x {} of {} on {}, got {}",
                    tensors[m.index].name, m.rows, m.cols, to_string(grad.dtype), grad.device.str(),
                    m.error.describe());
    if (m.deferred()) {
      BAGUA_CHECK_ARG(m.error.numel > 0 && grad.device.type == DeviceType::kCPU &&
                          state_fits(m.p_prev, m.rows * options_.rank) &&
                          state_fits(m.q_prev, m.cols * options_.rank),
                      "powersgd: the deferred error of '{}' needs error feedback on host memory "
                      "and p_prev {} x {}, q_prev {} x {} of {} (got {} and {})",
                      tensors[m.index].name, m.rows, options_.rank, m.cols, options_.rank,
                      to_string(grad.dtype), m.p_prev.describe(), m.q_prev.describe());
    }
    compressed[m.index] = true;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!compressed[i]) vectors_.push_back(static_cast<std::int64_t>(i));
  }
}

void PowerSGDOp::execute(Bucket& bucket) {
  // A bucket without a compressed matrix still sends 8-bit codes: its tensors
  // are coded as if they rode with P in a bucket that has matrices, so how
  // the tensors are bucketed does not change the bits (at two ranks).
  if (compressing() && (!matrices_.empty() || options_.low_precision)) {
    average_compressed(bucket);
    return;
  }
  for_flat_bucket(bucket, [&](const TensorView& data) {
    global().allreduce(data, data, ReduceOp::kAvg);
    exchanged_bytes_ += static_cast<std::int64_t>(data.nbytes());
    uncompressed_bytes_ += static_cast<std::int64_t>(data.nbytes());
  });
}

// Each phase is a span on the timeline when one is set (BAGUA_TIMELINE), so
// a step's time can be split into factor passes and exchanges.
void PowerSGDOp::average_compressed(Bucket& bucket) {
  const ByteMeter meter(*this, {&global()});
  Compute& c = compute_on(bucket.device());
  const CachingAllocator::Block first_block = scratch_for(c, bucket, first_numel(bucket));
  const TensorView first = c.view(first_block, first_numel(bucket), bucket.dtype());
  {
    const TimelinePhase phase("powersgd.project");
    project(c, bucket, first);
  }
  std::int64_t divisor = 1;
  {
    const TimelinePhase phase("powersgd.exchange_p");
    divisor = exchange(first, first_segments(bucket));
  }
  if (matrices_.empty()) {  // vectors only: no Q to exchange
    scatter_vectors(c, bucket, first, divisor);
    uncompressed_bytes_ += static_cast<std::int64_t>(bucket.nbytes());
    return;
  }
  const CachingAllocator::Block q_block = scratch_for(c, bucket, q_numel());
  const TensorView qs = c.view(q_block, q_numel(), bucket.dtype());
  {
    const TimelinePhase phase("powersgd.project_back");
    scatter_vectors(c, bucket, first, divisor);
    project_back(c, bucket, first, qs);
  }
  {
    const TimelinePhase phase("powersgd.exchange_q");
    divisor = exchange(qs, q_segments());
  }
  {
    const TimelinePhase phase("powersgd.reconstruct");
    if (divisor > 1) c.divide(qs, divisor);
    reconstruct(c, bucket, first, qs);
  }
  uncompressed_bytes_ += static_cast<std::int64_t>(bucket.nbytes());
}

// The first exchange holds the vectors, then P of every matrix; the second
// Q of every matrix.
std::int64_t PowerSGDOp::vectors_numel(const Bucket& bucket) const {
  std::int64_t numel = 0;
  for (const auto i : vectors_) numel += bucket.tensors()[i].view.numel;
  return numel;
}

std::int64_t PowerSGDOp::first_numel(const Bucket& bucket) const {
  std::int64_t numel = vectors_numel(bucket);
  for (const auto& m : matrices_) numel += m.rows * options_.rank;
  return numel;
}

std::vector<std::int64_t> PowerSGDOp::first_segments(const Bucket& bucket) const {
  std::vector<std::int64_t> lengths;
  for (const auto i : vectors_) lengths.push_back(bucket.tensors()[i].view.numel);
  for (const auto& m : matrices_) lengths.push_back(m.rows * options_.rank);
  return lengths;
}

std::vector<std::int64_t> PowerSGDOp::q_segments() const {
  std::vector<std::int64_t> lengths;
  for (const auto& m : matrices_) lengths.push_back(m.cols * options_.rank);
  return lengths;
}

std::int64_t PowerSGDOp::q_numel() const {
  std::int64_t numel = 0;
  for (const auto& m : matrices_) numel += m.cols * options_.rank;
  return numel;
}

CachingAllocator::Block PowerSGDOp::scratch_for(Compute& c, const Bucket& bucket,
                                                std::int64_t numel) {
  return c.scratch(static_cast<std::size_t>(numel) * dtype_size(bucket.dtype()));
}

// P of matrix k in the first exchange's buffer.
TensorView PowerSGDOp::p_of(const TensorView& first, std::int64_t vectors_end,
                            std::size_t k) const {
  std::int64_t offset = vectors_end;
  for (std::size_t i = 0; i < k; ++i) offset += matrices_[i].rows * options_.rank;
  return first.slice(offset, matrices_[k].rows * options_.rank);
}

// The vectors copied in, then M += error and P = M Q for every matrix.
void PowerSGDOp::project(Compute& c, const Bucket& bucket, const TensorView& first) {
  const auto& tensors = bucket.tensors();
  std::int64_t offset = 0;
  for (const auto i : vectors_) {
    const TensorView& v = tensors[i].view;
    c.copy(first.slice(offset, v.numel).data, v.data, v.nbytes());
    offset += v.numel;
  }
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const auto& m = matrices_[k];
    const TensorView& grad = tensors[m.index].view;
    if (m.deferred()) {
      low_rank_project_deferred(shape_of(m), grad, m.error, m.p_prev, m.q_prev, m.q,
                                p_of(first, offset, k));
    } else {
      low_rank_project(c, shape_of(m), grad, m.error, m.q, p_of(first, offset, k));
    }
  }
}

// The averaged vectors back into the bucket (divided by `divisor`).
void PowerSGDOp::scatter_vectors(Compute& c, Bucket& bucket, const TensorView& first,
                                 std::int64_t divisor) {
  std::int64_t offset = 0;
  for (const auto i : vectors_) {
    const TensorView& v = bucket.tensors()[i].view;
    c.copy(v.data, first.slice(offset, v.numel).data, v.nbytes());
    if (divisor > 1) c.divide(v, divisor);
    offset += v.numel;
  }
}

// P orthogonalized, then Q = M^T P of every matrix into `qs`.
void PowerSGDOp::project_back(Compute& c, const Bucket& bucket, const TensorView& first,
                              const TensorView& qs) {
  const std::int64_t vectors_end = vectors_numel(bucket);
  std::int64_t offset = 0;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const auto& m = matrices_[k];
    const TensorView p = p_of(first, vectors_end, k);
    orthogonalize_columns(c, shape_of(m), p, options_.orthogonalization_epsilon);
    // M: in the gradient's memory, or kept apart with the error deferred.
    const TensorView& matrix = m.deferred() ? m.error : bucket.tensors()[m.index].view;
    low_rank_project_back(c, shape_of(m), matrix, p, qs.slice(offset, m.cols * options_.rank));
    offset += m.cols * options_.rank;
  }
}

// Q kept for the next step, M = P Q^T, error = M_before - M.
void PowerSGDOp::reconstruct(Compute& c, Bucket& bucket, const TensorView& first,
                             const TensorView& qs) {
  const std::int64_t vectors_end = vectors_numel(bucket);
  std::int64_t offset = 0;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const auto& m = matrices_[k];
    c.copy(m.q.data, qs.slice(offset, m.cols * options_.rank).data, m.q.nbytes());
    const TensorView p = p_of(first, vectors_end, k);
    if (m.deferred()) {  // the error stays implicit: the factors are kept instead
      low_rank_write_approximation(shape_of(m), bucket.tensors()[m.index].view, p, m.q);
      c.copy(m.p_prev.data, p.data, m.p_prev.nbytes());
      c.copy(m.q_prev.data, m.q.data, m.q_prev.nbytes());
    } else {
      low_rank_reconstruct(c, shape_of(m), bucket.tensors()[m.index].view, m.error, p, m.q);
    }
    offset += m.cols * options_.rank;
  }
}

std::int64_t PowerSGDOp::exchange(const TensorView& data,
                                  const std::vector<std::int64_t>& segments) {
  if (options_.low_precision && global().size() > 1) return average_8bit(data, segments);
  if (global().size() == 2) {
    sum_of_two(data);
  } else {
    global().allreduce(data, data, ReduceOp::kSum);
  }
  exchanged_bytes_ += static_cast<std::int64_t>(data.nbytes());
  return global().size();
}

// The factors are small, so their exchanges cost round trips more than bytes
// (several ms each on a busy machine, where every hand-off between threads
// can wait a time slice). At two ranks an allgather sends the same bytes as
// the ring allreduce (each rank its whole buffer) in one round instead of
// two; each rank then adds the two in rank order, the ring's bits.
void PowerSGDOp::sum_of_two(const TensorView& data) {
  Compute& c = compute();
  const auto block = c.scratch(2 * data.nbytes());
  const TensorView both = c.view(block, 2 * data.numel, data.dtype);
  global().allgather(data, both);
  c.copy(data.data, both.data, data.nbytes());
  c.axpby(1.0, both.slice(data.numel, data.numel), 1.0, data);
}

std::int64_t PowerSGDOp::average_8bit(const TensorView& data,
                                      const std::vector<std::int64_t>& segments) {
  Communicator& comm = global();
  Compute& c = compute();
  // The 8-bit average runs on float32 host memory: other dtypes go through
  // a float32 copy, device buffers through pinned host memory.
  const bool on_host = data.device.type == DeviceType::kCPU;
  const Float32Work work_copy = float32_work(c, data);
  const TensorView& work = work_copy.view;
  CachingAllocator::Block host_block;
  TensorView host = work;
  if (!on_host) {
    host_block = pinned_host_pool().allocate(work.nbytes());
    host = TensorView{host_block.data(), work.numel, DType::kFloat32, Device{}};
    c.run_custom([] {}, [&](void* s) { cuda_copy_async(host.data, work.data, work.nbytes(), s); });
    c.finish("powersgd: 8-bit staging to the host", env().comm_timeout);
  }
  if (comm.size() == 2) {
    exchanged_bytes_ += average_8bit_of_two(host, segments);
  } else {
    std::vector<int> members(static_cast<std::size_t>(comm.size()));
    std::iota(members.begin(), members.end(), 0);
    // Each tensor coded apart, as at two ranks (average_8bit_of_two).
    const CodeLayout layout{segments, kCodeChunk};
    low_precision_partial_allreduce(comm, host, members, comm.next_partial_id(members), layout);
    exchanged_bytes_ += low_precision_coded_bytes(host.numel, comm.size(), layout);
  }
  if (!on_host) {
    c.run_custom([] {}, [&](void* s) { cuda_copy_async(work.data, host.data, work.nbytes(), s); });
  }
  if (work_copy.is_copy()) c.convert(work, data);
  if (!on_host) c.finish("powersgd: 8-bit staging from the host", env().comm_timeout);
  return 1;
}

// At two ranks the scatter-gather takes two rounds; an allgather of each
// rank's codes sends the same bytes in one (see sum_of_two). Both ranks
// decode the same codes and average them in rank order, so they hold the
// same bits, and each value is quantized once (the scatter-gather quantizes
// the average again). Each segment (a vector, one matrix's factor) has its
// own chunks of a min/max per kCodeChunk elements: the tensors differ in
// scale, and a chunk across two of them would quantize the smaller with the
// larger's range. Returns the bytes this rank sent.
std::int64_t PowerSGDOp::average_8bit_of_two(const TensorView& host,
                                             const std::vector<std::int64_t>& segments) {
  std::vector<minmax_uint8::ChunkedLayout> layouts;
  std::size_t bytes = 0;
  for (const auto length : segments) {
    layouts.push_back({length, kCodeChunk});
    bytes += layouts.back().bytes();
  }
  std::vector<std::byte> codes(3 * bytes);  // this rank's, then rank 0's and rank 1's
  const auto for_segments = [&](std::size_t code_offset, const auto& fn) {
    std::int64_t element = 0;
    for (const auto& layout : layouts) {
      fn(host.slice(element, layout.numel), layout, codes.data() + code_offset);
      element += layout.numel;
      code_offset += layout.bytes();
    }
  };
  for_segments(0, [](const TensorView& x, const auto& layout, std::byte* out) {
    minmax_uint8::compress_chunked(x, layout, out);
  });
  const auto bytes_view = [&](std::size_t offset, std::size_t count) {
    return TensorView{codes.data() + offset, static_cast<std::int64_t>(count), DType::kUInt8, {}};
  };
  global().allgather(bytes_view(0, bytes), bytes_view(bytes, 2 * bytes));
  for (int from = 0; from < 2; ++from) {
    for_segments((1 + from) * bytes, [&](const TensorView& x, const auto& layout, std::byte* in) {
      minmax_uint8::decompress_chunked(in, layout, x, from == 1);
    });
  }
  divide_inplace(host, 2);
  return static_cast<std::int64_t>(bytes);
}

}  // namespace bagua
