// Averaging on the device: x /= divisor, with the per-element formula shared
// with the CPU path (bagua/core/element_math.h).
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launchers.h"

namespace bagua::kernels {
namespace {

template <typename T>
__global__ void divide_kernel(T* x, std::int64_t count, std::int64_t divisor) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    x[i] = divide_one(x[i], divisor);
  }
}

template <typename T>
void launch_divide(void* x, std::int64_t numel, std::int64_t divisor, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const std::int64_t wanted = (numel + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  divide_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(x), numel, divisor);
}

}  // namespace

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the "no driver" error so later calls start clean
    return 0;
  }
  return count;
}

const char* divide_inplace(void* x, std::int64_t numel, int dtype, std::int64_t divisor,
                           void* stream) noexcept {
  if (numel == 0 || divisor == 1) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch_divide<float>(x, numel, divisor, s); break;
    case DType::kFloat64: launch_divide<double>(x, numel, divisor, s); break;
    case DType::kFloat16: launch_divide<Half>(x, numel, divisor, s); break;
    case DType::kBFloat16: launch_divide<BFloat16>(x, numel, divisor, s); break;
    case DType::kInt32: launch_divide<std::int32_t>(x, numel, divisor, s); break;
    case DType::kInt64: launch_divide<std::int64_t>(x, numel, divisor, s); break;
    case DType::kUInt8: launch_divide<std::uint8_t>(x, numel, divisor, s); break;
  }
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

}  // namespace bagua::kernels
