// Host entry points of the CUDA kernels. Compiled by nvcc, called from the
// C++ runtime (lib/runtime/cuda_support.cc), which turns their status into
// exceptions: this header stays free of C++ library dependencies so both
// compilers read it the same way.
#pragma once

#include <cstdint>

namespace bagua::kernels {

// Devices the driver reports; 0 when there is no driver or no device.
int device_count() noexcept;

// x[0:numel] /= divisor on `stream`; `dtype` is a bagua::DType value.
// Returns nullptr on success, else the CUDA error string.
const char* divide_inplace(void* x, std::int64_t numel, int dtype, std::int64_t divisor,
                           void* stream) noexcept;

}  // namespace bagua::kernels
