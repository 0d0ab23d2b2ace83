// The comm ops' own element-wise kernels, applying the formulas of
// bagua/ops/op_math.h that the host loops (bagua/ops/op_steps.h) apply too:
// - async_average_update: w = w + sum / n - snapshot (asynchronous model
//   average);
// - ring_diff: the difference the low-precision decentralized op compresses;
// - async_average_drift: ||snapshot - sum / n||^2 and ||sum / n||^2 (the
//   asynchronous model average's drift figures), a block reduction in
//   double, one atomicAdd per block.
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/ops/op_math.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

template <typename T>
__global__ void async_update_kernel(T* w, const T* sum, const T* snapshot, std::int64_t count,
                                    std::int64_t ranks) {
  for_each_index(count, [&](std::int64_t i) {
    w[i] = ::bagua::async_average_update(w[i], sum[i], snapshot[i], ranks);
  });
}

template <typename T>
__global__ void ring_diff_kernel(const T* x, const T* w, const T* l, const T* r, float* diff,
                                 std::int64_t count) {
  for_each_index(
      count, [&](std::int64_t i) { diff[i] = low_precision_ring_diff(x[i], w[i], l[i], r[i]); });
}

template <typename T>
__global__ void async_drift_kernel(const T* sum, const T* snapshot, std::int64_t count,
                                   std::int64_t ranks, double* out) {
  __shared__ double drift[kThreads];
  __shared__ double average[kThreads];
  double d2 = 0, a2 = 0;
  for_each_index(count, [&](std::int64_t i) {
    const double mean = static_cast<double>(load(sum[i])) / static_cast<double>(ranks);
    const double d = static_cast<double>(load(snapshot[i])) - mean;
    d2 += d * d;
    a2 += mean * mean;
  });
  drift[threadIdx.x] = d2;
  average[threadIdx.x] = a2;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      drift[threadIdx.x] += drift[threadIdx.x + half];
      average[threadIdx.x] += average[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(&out[0], drift[0]);
    atomicAdd(&out[1], average[0]);
  }
}

}  // namespace

const char* async_average_drift(const void* sum, const void* snapshot, std::int64_t numel,
                                std::int64_t ranks, int dtype, double* out, void* stream) noexcept {
  if (numel == 0) return nullptr;
  return launch_for_type(dtype, "async_average_drift: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    async_drift_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(sum), static_cast<const T*>(snapshot), numel, ranks, out);
  });
}

const char* async_average_update(void* w, const void* sum, const void* snapshot, std::int64_t numel,
                                 std::int64_t ranks, int dtype, void* stream) noexcept {
  if (numel == 0) return nullptr;
  return launch_for_type(dtype, "async_average_update: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    async_update_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(w), static_cast<const T*>(sum), static_cast<const T*>(snapshot), numel,
        ranks);
  });
}

const char* ring_diff(const void* x, const void* w, const void* l, const void* r, float* diff,
                      std::int64_t numel, int dtype, void* stream) noexcept {
  if (numel == 0) return nullptr;
  return launch_for_type(dtype, "ring_diff: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    ring_diff_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(l),
        static_cast<const T*>(r), diff, numel);
  });
}

}  // namespace bagua::kernels
