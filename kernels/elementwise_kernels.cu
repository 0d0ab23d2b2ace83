// Generic element-wise kernels of Compute on the device:
// - divide_inplace: x /= divisor, the averaging step after a sum;
// - axpby: y = a * x + b * y, the residual arithmetic of error feedback;
// - convert: a dtype cast, for the fp32 working copy of compressed ops.
// They compute through the shared element math (bagua/core/element_math.h),
// so 16-bit values round as on the CPU path.
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

template <typename T>
__global__ void divide_kernel(T* x, std::int64_t count, std::int64_t divisor) {
  for_each_index(count, [&](std::int64_t i) { x[i] = divide_one(x[i], divisor); });
}

template <typename T>
__global__ void axpby_kernel(compute_type_t<T> a, const T* x, compute_type_t<T> b, T* y,
                             std::int64_t count) {
  for_each_index(count, [&](std::int64_t i) { y[i] = store<T>(a * load(x[i]) + b * load(y[i])); });
}

template <typename From, typename To>
__global__ void convert_kernel(const From* from, To* to, std::int64_t count) {
  for_each_index(count, [&](std::int64_t i) {
    to[i] = store<To>(static_cast<compute_type_t<To>>(load(from[i])));
  });
}

}  // namespace

const char* divide_inplace(void* x, std::int64_t numel, int dtype, std::int64_t divisor,
                           void* stream) noexcept {
  if (numel == 0 || divisor == 1) return nullptr;
  return launch_for_type(dtype, "divide_inplace: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    divide_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(x), numel, divisor);
  });
}

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
