// Element-wise helpers of the comm ops on the device:
// - axpby: y = a * x + b * y, the residual arithmetic of error feedback;
// - convert: a dtype cast, for the fp32 working copy of compressed ops;
// - ring_diff: the difference the low-precision decentralized op compresses.
// Both compute through the shared element math (load/store of
// bagua/core/element_math.h), so 16-bit values round as on the CPU path.
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launchers.h"

namespace bagua::kernels {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t count) {
  const std::int64_t wanted = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
}

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

// Calls launch(T{}) with T the type of `dtype`; false for an unknown value.
template <typename Launch>
bool with_type(int dtype, Launch&& launch) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch(float{}); return true;
    case DType::kFloat64: launch(double{}); return true;
    case DType::kFloat16: launch(Half{}); return true;
    case DType::kBFloat16: launch(BFloat16{}); return true;
    case DType::kInt32: launch(std::int32_t{}); return true;
    case DType::kInt64: launch(std::int64_t{}); return true;
    case DType::kUInt8: launch(std::uint8_t{}); return true;
  }
  return false;
}

const char* last_error() {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

}  // namespace

const char* axpby(double a, const void* x, double b, void* y, std::int64_t numel, int dtype,
                  void* stream) noexcept {
  if (numel == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32:
      axpby_kernel<float><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<float>(a), static_cast<const float*>(x), static_cast<float>(b),
          static_cast<float*>(y), numel);
      break;
    case DType::kFloat64:
      axpby_kernel<double><<<blocks_for(numel), kThreads, 0, s>>>(
          a, static_cast<const double*>(x), b, static_cast<double*>(y), numel);
      break;
    case DType::kFloat16:
      axpby_kernel<Half><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<float>(a), static_cast<const Half*>(x), static_cast<float>(b),
          static_cast<Half*>(y), numel);
      break;
    case DType::kBFloat16:
      axpby_kernel<BFloat16><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<float>(a), static_cast<const BFloat16*>(x), static_cast<float>(b),
          static_cast<BFloat16*>(y), numel);
      break;
    default: return "axpby: floating point dtypes only";
  }
  return last_error();
}

const char* ring_diff(const void* x, const void* w, const void* l, const void* r, float* diff,
                      std::int64_t numel, int dtype, void* stream) noexcept {
  if (numel == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const bool known = with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    ring_diff_kernel<T><<<blocks_for(numel), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(l),
        static_cast<const T*>(r), diff, numel);
  });
  if (!known) return "ring_diff: unknown dtype";
  return last_error();
}

const char* convert(const void* from, int from_dtype, void* to, int to_dtype, std::int64_t numel,
                    void* stream) noexcept {
  if (numel == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  bool known = false;
  with_type(from_dtype, [&](auto from_tag) {
    using From = decltype(from_tag);
    known = with_type(to_dtype, [&](auto to_tag) {
      using To = decltype(to_tag);
      convert_kernel<From, To><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<const From*>(from), static_cast<To*>(to), numel);
    });
  });
  if (!known) return "convert: unknown dtype";
  return last_error();
}

}  // namespace bagua::kernels
