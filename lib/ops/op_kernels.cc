// The ops' kernel wrappers of bagua/ops/op_steps.h in a build with CUDA:
// argument checks around the launchers of kernels/op_kernels.cu, their
// status turned into exceptions (core/cuda_checks.h).
#include "bagua/core/errors.h"
#include "bagua/ops/low_rank_steps.h"
#include "bagua/ops/op_steps.h"
#include "core/cuda_checks.h"
#include "launchers.h"

namespace bagua {

void cuda_async_average_update(const TensorView& w, const TensorView& sum,
                               const TensorView& snapshot, std::int64_t ranks, void* stream) {
  for (const auto* view : {&w, &sum, &snapshot}) {
    BAGUA_CHECK_ARG(
        view->device.type == DeviceType::kCUDA && view->numel == w.numel && view->dtype == w.dtype,
        "cuda_async_average_update: {} does not match {}", view->describe(), w.describe());
  }
  BAGUA_CHECK_ARG(ranks > 0, "cuda_async_average_update: ranks must be positive, got {}", ranks);
  detail::check_launch(kernels::async_average_update(w.data, sum.data, snapshot.data, w.numel,
                                                     ranks, static_cast<int>(w.dtype), stream),
                       "cuda_async_average_update", w);
}

void cuda_async_average_drift(const TensorView& sum, const TensorView& snapshot, std::int64_t ranks,
                              double* d_out, void* stream) {
  BAGUA_CHECK_ARG(sum.device.type == DeviceType::kCUDA && snapshot.device == sum.device &&
                      snapshot.numel == sum.numel && snapshot.dtype == sum.dtype,
                  "cuda_async_average_drift: {} does not match {}", snapshot.describe(),
                  sum.describe());
  BAGUA_CHECK_ARG(ranks > 0, "cuda_async_average_drift: ranks must be positive, got {}", ranks);
  BAGUA_CHECK_ARG(d_out != nullptr, "cuda_async_average_drift: no output");
  detail::check_launch(kernels::async_average_drift(sum.data, snapshot.data, sum.numel, ranks,
                                                    static_cast<int>(sum.dtype), d_out, stream),
                       "cuda_async_average_drift", sum);
}

void cuda_low_precision_ring_diff(const TensorView& x, const TensorView& w, const TensorView& l,
                                  const TensorView& r, const TensorView& diff, void* stream) {
  for (const auto* view : {&w, &l, &r}) {
    BAGUA_CHECK_ARG(view->device == x.device && view->numel == x.numel && view->dtype == x.dtype,
                    "cuda_low_precision_ring_diff: {} does not match {}", view->describe(),
                    x.describe());
  }
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA && diff.device == x.device &&
                      diff.numel == x.numel && diff.dtype == DType::kFloat32,
                  "cuda_low_precision_ring_diff: diff {} for {}", diff.describe(), x.describe());
  detail::check_launch(
      kernels::ring_diff(x.data, w.data, l.data, r.data, static_cast<float*>(diff.data), x.numel,
                         static_cast<int>(x.dtype), stream),
      "cuda_low_precision_ring_diff", x);
}

namespace {

// Every operand of a low-rank step: on one CUDA device, of m's dtype, of the
// size the shape gives (error may be empty).
void check_low_rank(const char* what, LowRankShape s, const TensorView& m, const TensorView& p,
                    const TensorView& q, const TensorView* error) {
  const auto fits = [&](const TensorView& v, std::int64_t numel) {
    return v.device.type == DeviceType::kCUDA && v.device == m.device && v.dtype == m.dtype &&
           v.numel == numel;
  };
  BAGUA_CHECK_ARG(s.rows >= 0 && s.cols >= 0 && s.rank >= 1 && fits(m, s.rows * s.cols) &&
                      fits(p, s.rows * s.rank) && fits(q, s.cols * s.rank) &&
                      (error == nullptr || error->numel == 0 || fits(*error, s.rows * s.cols)),
                  "{}: {} x {} rank {} does not match m {}, p {}, q {}", what, s.rows, s.cols,
                  s.rank, m.describe(), p.describe(), q.describe());
}

void* data_or_null(const TensorView& v) { return v.numel > 0 ? v.data : nullptr; }

}  // namespace

void cuda_low_rank_project(LowRankShape s, const TensorView& m, const TensorView& error,
                           const TensorView& q, const TensorView& p, void* stream) {
  check_low_rank("cuda_low_rank_project", s, m, p, q, &error);
  detail::check_launch(
      kernels::low_rank_project(m.data, data_or_null(error), q.data, p.data, s.rows, s.cols, s.rank,
                                static_cast<int>(m.dtype), stream),
      "cuda_low_rank_project", m);
}

void cuda_low_rank_project_back(LowRankShape s, const TensorView& m, const TensorView& p,
                                const TensorView& accumulator, const TensorView& q, void* stream) {
  check_low_rank("cuda_low_rank_project_back", s, m, p, q, nullptr);
  const DType acc = m.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  BAGUA_CHECK_ARG(accumulator.device == m.device && accumulator.dtype == acc &&
                      accumulator.numel == s.cols * s.rank,
                  "cuda_low_rank_project_back: accumulator {} for q {}", accumulator.describe(),
                  q.describe());
  detail::check_launch(
      kernels::low_rank_project_back(m.data, p.data, accumulator.data, q.data, s.rows, s.cols,
                                     s.rank, static_cast<int>(m.dtype), stream),
      "cuda_low_rank_project_back", m);
}

void cuda_low_rank_reconstruct(LowRankShape s, const TensorView& m, const TensorView& error,
                               const TensorView& p, const TensorView& q, void* stream) {
  check_low_rank("cuda_low_rank_reconstruct", s, m, p, q, &error);
  detail::check_launch(
      kernels::low_rank_reconstruct(m.data, data_or_null(error), p.data, q.data, s.rows, s.cols,
                                    s.rank, static_cast<int>(m.dtype), stream),
      "cuda_low_rank_reconstruct", m);
}

void cuda_orthogonalize_columns(LowRankShape s, const TensorView& p, double epsilon, void* stream) {
  BAGUA_CHECK_ARG(p.device.type == DeviceType::kCUDA && p.numel == s.rows * s.rank,
                  "cuda_orthogonalize_columns: {} is not {} x {} on a GPU", p.describe(), s.rows,
                  s.rank);
  detail::check_launch(kernels::orthogonalize_columns(p.data, s.rows, s.rank, epsilon,
                                                      static_cast<int>(p.dtype), stream),
                       "cuda_orthogonalize_columns", p);
}

}  // namespace bagua
