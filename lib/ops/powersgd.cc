// PowerSGDOp (bagua/ops/powersgd.h): one step is project, exchange P,
// orthogonalize, project back, exchange Q, reconstruct, all on the bucket's
// device through its Compute.
#include "bagua/ops/powersgd.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
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
    compressed[m.index] = true;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!compressed[i]) vectors_.push_back(static_cast<std::int64_t>(i));
  }
}

void PowerSGDOp::execute(Bucket& bucket) {
  if (compressing() && !matrices_.empty()) {
    average_compressed(bucket);
    return;
  }
  for_flat_bucket(bucket, [&](const TensorView& data) {
    global().allreduce(data, data, ReduceOp::kAvg);
    exchanged_bytes_ += static_cast<std::int64_t>(data.nbytes());
    uncompressed_bytes_ += static_cast<std::int64_t>(data.nbytes());
  });
}

void PowerSGDOp::average_compressed(Bucket& bucket) {
  const ByteMeter meter(*this, {&global()});
  Compute& c = compute_on(bucket.device());
  const auto& tensors = bucket.tensors();
  const DType dtype = bucket.dtype();
  const std::size_t element = dtype_size(dtype);
  const std::int64_t r = options_.rank;

  // The first exchange: the vectors, then P of every matrix.
  std::int64_t first_numel = 0;
  for (const auto i : vectors_) first_numel += tensors[i].view.numel;
  for (const auto& m : matrices_) first_numel += m.rows * r;
  const auto first_block = c.scratch(static_cast<std::size_t>(first_numel) * element);
  const TensorView first = c.view(first_block, first_numel, dtype);
  std::int64_t offset = 0;
  for (const auto i : vectors_) {
    const TensorView& v = tensors[i].view;
    c.copy(first.slice(offset, v.numel).data, v.data, v.nbytes());
    offset += v.numel;
  }
  std::vector<TensorView> ps;
  for (const auto& m : matrices_) {
    ps.push_back(first.slice(offset, m.rows * r));
    low_rank_project(c, shape_of(m), tensors[m.index].view, m.error, m.q, ps.back());
    offset += m.rows * r;
  }
  const std::int64_t divisor = exchange(first);
  offset = 0;
  for (const auto i : vectors_) {
    const TensorView& v = tensors[i].view;
    c.copy(v.data, first.slice(offset, v.numel).data, v.nbytes());
    if (divisor > 1) c.divide(v, divisor);
    offset += v.numel;
  }
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    orthogonalize_columns(c, shape_of(matrices_[k]), ps[k], options_.orthogonalization_epsilon);
  }

  // The second exchange: Q = M^T P of every matrix, averaged.
  std::int64_t q_numel = 0;
  for (const auto& m : matrices_) q_numel += m.cols * r;
  const auto q_block = c.scratch(static_cast<std::size_t>(q_numel) * element);
  const TensorView qs = c.view(q_block, q_numel, dtype);
  offset = 0;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const auto& m = matrices_[k];
    low_rank_project_back(c, shape_of(m), tensors[m.index].view, ps[k],
                          qs.slice(offset, m.cols * r));
    offset += m.cols * r;
  }
  const std::int64_t q_divisor = exchange(qs);
  if (q_divisor > 1) c.divide(qs, q_divisor);
  offset = 0;
  for (std::size_t k = 0; k < matrices_.size(); ++k) {
    const auto& m = matrices_[k];
    c.copy(m.q.data, qs.slice(offset, m.cols * r).data, m.q.nbytes());
    low_rank_reconstruct(c, shape_of(m), tensors[m.index].view, m.error, ps[k], m.q);
    offset += m.cols * r;
  }
  uncompressed_bytes_ += static_cast<std::int64_t>(bucket.nbytes());
}

std::int64_t PowerSGDOp::exchange(const TensorView& data) {
  if (options_.low_precision && global().size() > 1) return average_8bit(data);
  global().allreduce(data, data, ReduceOp::kSum);
  exchanged_bytes_ += static_cast<std::int64_t>(data.nbytes());
  return global().size();
}

std::int64_t PowerSGDOp::average_8bit(const TensorView& data) {
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
  std::vector<int> members(static_cast<std::size_t>(comm.size()));
  std::iota(members.begin(), members.end(), 0);
  low_precision_partial_allreduce(comm, host, members, comm.next_partial_id(members));
  if (!on_host) {
    c.run_custom([] {}, [&](void* s) { cuda_copy_async(work.data, host.data, work.nbytes(), s); });
  }
  if (work_copy.is_copy()) c.convert(work, data);
  if (!on_host) c.finish("powersgd: 8-bit staging from the host", env().comm_timeout);
  // one code byte per element, and a min/max header per chunk and rank
  exchanged_bytes_ += data.numel + std::int64_t{8} * comm.size();
  return 1;
}

}  // namespace bagua
