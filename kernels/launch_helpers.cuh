// What every kernel file shares: the launch shape (grid-stride loops over
// 256-thread blocks, at most 65535 blocks), the grid-stride loop itself, the
// dtype dispatch of the launchers, and the conversion of the launch status
// into the launchers' error convention (nullptr on success).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bagua/core/dtype.h"
#include "bagua/core/half.h"

namespace bagua::kernels {

constexpr int kThreads = 256;

inline unsigned blocks_for(std::int64_t count) {
  const std::int64_t wanted = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
}

// Calls body(i) for each index i < count that falls to this thread: the
// grid-stride loop of every element-wise kernel, so any grid covers any count.
template <typename Body>
__device__ inline void for_each_index(std::int64_t count, Body&& body) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    body(i);
  }
}

// Calls launch(T{}) with T the C++ type of `dtype`; false for an unknown value.
template <typename Launch>
bool dispatch_type(int dtype, Launch&& launch) {
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

// nullptr when the last launch succeeded, else CUDA's error string.
inline const char* last_launch_error() {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

// dispatch_type, then the launch status; `what` names an unknown dtype.
template <typename Launch>
const char* launch_for_type(int dtype, const char* what, Launch&& launch) {
  if (!dispatch_type(dtype, launch)) return what;
  return last_launch_error();
}

}  // namespace bagua::kernels
