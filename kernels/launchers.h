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

// MinMaxUInt8 over consecutive chunks of `chunk_elements` (the last may be
// shorter): `out` receives, per chunk, [min f32][max f32][codes]. The codes
// equal the CPU path's (bagua/compression/minmax_uint8.h) bit for bit.
const char* minmax_uint8_compress(const void* x, std::int64_t numel, int dtype,
                                  std::int64_t chunk_elements, void* out, void* stream) noexcept;

// Decodes what minmax_uint8_compress wrote into `out` (adding when
// `accumulate`).
const char* minmax_uint8_decompress(const void* in, std::int64_t numel, int dtype,
                                    std::int64_t chunk_elements, void* out, bool accumulate,
                                    void* stream) noexcept;

}  // namespace bagua::kernels
