// The ops' kernel wrappers of bagua/ops/op_steps.h in a build with CUDA:
// argument checks around the launchers of kernels/op_kernels.cu, their
// status turned into exceptions (core/cuda_checks.h).
#include "bagua/core/errors.h"
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

}  // namespace bagua
