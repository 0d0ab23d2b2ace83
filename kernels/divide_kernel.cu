// Averaging on the device: x /= divisor, with the per-element formula shared
// with the CPU path (bagua/core/element_math.h).
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launch_helpers.cuh"
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
  return launch_for_type(dtype, "divide_inplace: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    divide_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(x), numel, divisor);
  });
}

}  // namespace bagua::kernels
