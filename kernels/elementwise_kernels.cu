// Element-wise helpers of the comm ops on the device:
// - axpby: y = a * x + b * y, the residual arithmetic of error feedback;
// - convert: a dtype cast, for the fp32 working copy of compressed ops;
// - ring_diff: the difference the low-precision decentralized op compresses.
// Both compute through the shared element math (load/store of
// bagua/core/element_math.h), so 16-bit values round as on the CPU path.
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

template <typename T>
__global__ void axpby_kernel(compute_type_t<T> a, const T* x, compute_type_t<T> b, T* y,
                             std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    y[i] = store<T>(a * load(x[i]) + b * load(y[i]));
  }
}

template <typename From, typename To>
__global__ void convert_kernel(const From* from, To* to, std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    to[i] = store<To>(static_cast<compute_type_t<To>>(load(from[i])));
  }
}

template <typename T>
__global__ void ring_diff_kernel(const T* x, const T* w, const T* l, const T* r, float* diff,
                                 std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    diff[i] = low_precision_ring_diff(x[i], w[i], l[i], r[i]);
  }
}

}  // namespace

const char* axpby(double a, const void* x, double b, void* y, std::int64_t numel, int dtype,
                  void* stream) noexcept {
  if (numel == 0) return nullptr;
  if (!is_floating_point(static_cast<DType>(dtype))) return "axpby: floating point dtypes only";
  return launch_for_type(dtype, "axpby: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      using C = compute_type_t<T>;
      axpby_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<C>(a), static_cast<const T*>(x), static_cast<C>(b), static_cast<T*>(y),
          numel);
    }
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

const char* convert(const void* from, int from_dtype, void* to, int to_dtype, std::int64_t numel,
                    void* stream) noexcept {
  if (numel == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  bool known = false;
  dispatch_type(from_dtype, [&](auto from_tag) {
    using From = decltype(from_tag);
    known = dispatch_type(to_dtype, [&](auto to_tag) {
      using To = decltype(to_tag);
      convert_kernel<From, To><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<const From*>(from), static_cast<To*>(to), numel);
    });
  });
  if (!known) return "convert: unknown dtype";
  return last_launch_error();
}

}  // namespace bagua::kernels
