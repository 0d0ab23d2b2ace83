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

// out[i] = sum over j < chunk_count of chunks[j * chunk_elements + i], divided
// by chunk_count when `mean` (the local step of the scatter-reduce).
const char* chunked_reduce(const void* chunks, std::int64_t chunk_count,
                           std::int64_t chunk_elements, int dtype, bool mean, void* out,
                           void* stream) noexcept;

// w[i] = w[i] + sum[i] / ranks - snapshot[i] (asynchronous model average).
const char* async_average_update(void* w, const void* sum, const void* snapshot, std::int64_t numel,
                                 std::int64_t ranks, int dtype, void* stream) noexcept;

// y[i] = a * x[i] + b * y[i] for floating dtypes (error feedback residuals).
const char* axpby(double a, const void* x, double b, void* y, std::int64_t numel, int dtype,
                  void* stream) noexcept;

// diff[i] (fp32) = low_precision_ring_diff(x[i], w[i], l[i], r[i]).
const char* ring_diff(const void* x, const void* w, const void* l, const void* r, float* diff,
                      std::int64_t numel, int dtype, void* stream) noexcept;

// to[i] = from[i] converted between any two dtypes.
const char* convert(const void* from, int from_dtype, void* to, int to_dtype, std::int64_t numel,
                    void* stream) noexcept;

// 0 when every launched kernel finished without error.
int synchronize_device() noexcept;

// Page-locked host memory and synchronous copies (cudaMemcpyDefault); each
// returns 0 on success.
int pinned_alloc(void** pointer, std::size_t bytes) noexcept;
void pinned_free(void* pointer) noexcept;
int copy(void* destination, const void* source, std::size_t bytes) noexcept;

}  // namespace bagua::kernels
