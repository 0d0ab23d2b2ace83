// What the runtime knows about CUDA at run time.
//
// The same binary runs with or without a GPU: when CUDA was compiled in
// (meson option `cuda`) the kernels in kernels/ are linked with the static
// CUDA runtime, and `cuda_device_count()` asks the driver, returning 0 (never
// throwing or aborting) when there is no driver or no device. Callers take
// the CPU path whenever it returns 0.
#pragma once

#include <cstdint>

#include "bagua/core/tensor_view.h"

namespace bagua {

// True when this build contains the CUDA kernels.
bool cuda_compiled() noexcept;

// Number of usable CUDA devices; 0 without a GPU, a driver, or a CUDA build.
int cuda_device_count() noexcept;

// x /= divisor on the device, on `stream` (a cudaStream_t, nullptr for the
// default stream). Throws InvalidArgument for host tensors or in a build
// without CUDA, BackendError when the launch fails.
void cuda_divide_inplace(const TensorView& x, std::int64_t divisor, void* stream);

// MinMaxUInt8 on the device, chunks of `chunk_elements` each with its own
// min/max; `out` is a device buffer of chunks * 8 + numel bytes. Same codes as
// the CPU path (bagua/compression/minmax_uint8.h).
void cuda_minmax_uint8_compress(const TensorView& x, std::int64_t chunk_elements, void* out,
                                void* stream);
void cuda_minmax_uint8_decompress(const void* in, std::int64_t chunk_elements,
                                  const TensorView& out, bool accumulate, void* stream);

// out = sum (or mean) over the chunk_count chunks of `chunks` (each of
// out.numel elements), on the device.
void cuda_chunked_reduce(const TensorView& chunks, std::int64_t chunk_count, const TensorView& out,
                         bool mean, void* stream);

// w = w + sum / ranks - snapshot on the device (asynchronous model average).
void cuda_async_average_update(const TensorView& w, const TensorView& sum,
                               const TensorView& snapshot, std::int64_t ranks, void* stream);

// Waits for all work on the device; throws BackendError if a kernel failed.
void cuda_synchronize();

// Host memory the GPU copies to and from at full speed (page-locked), or
// ordinary memory in a build without CUDA; nullptr for 0 bytes.
void* cuda_pinned_alloc(std::size_t bytes);
void cuda_pinned_free(void* pointer) noexcept;

// A synchronous copy between any two of host and device memory.
void cuda_copy(void* destination, const void* source, std::size_t bytes);

}  // namespace bagua
