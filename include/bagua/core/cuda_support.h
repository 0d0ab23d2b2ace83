// What the runtime knows about CUDA at run time.
//
// The same binary runs with or without a GPU: when CUDA was compiled in
// (meson option `cuda`) the kernels in kernels/ are linked with the static
// CUDA runtime, and `cuda_device_count()` asks the driver, returning 0 (never
// throwing or aborting) when there is no driver or no device. Callers take
// the CPU path whenever it returns 0.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "bagua/core/caching_allocator.h"
#include "bagua/core/event_pool.h"
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

// --- Streams, events and pools of the communication path ---------------------
//
// All of bagua's device work on one GPU runs on one stream, the
// communication stream: the ready-event waits, the kernels of the comm ops,
// the copies of host staging and the collectives of the NCCL communicators
// (except a dedicated communicator that asks for a stream of its own). One
// stream orders them without host round trips; it is created once per device
// with the highest priority, non-blocking with respect to the legacy default
// stream, so communication is not queued behind the training kernels.

// Makes `device` current for the calling thread.
void cuda_set_device(int device);

// The communication stream of `device` (a cudaStream_t), created on first use.
void* cuda_communication_stream(int device);

// A new high-priority non-blocking stream of `device`; the caller destroys it
// with cuda_stream_destroy.
void* cuda_stream_create(int device);
void cuda_stream_destroy(void* stream) noexcept;

// The host waits until the work enqueued on `stream` so far is done. Past
// `timeout` a TimeoutError names `what`; a failed kernel is a BackendError.
// Only that stream is waited for, never the whole device.
void cuda_stream_wait(void* stream, std::chrono::milliseconds timeout, std::string_view what);

// Events: `stream` waits (on the device) for the work `event` recorded.
void* cuda_event_create(int device);
void cuda_event_destroy(void* event) noexcept;
void cuda_event_record(void* event, void* stream);
void cuda_stream_wait_event(void* stream, void* event);

// Pools, one per device, created on first use and kept for the process.
EventPool& cuda_event_pool(int device);
CachingAllocator& cuda_device_pool(int device);
// Page-locked host memory for staging (ordinary memory without CUDA).
CachingAllocator& pinned_host_pool();

// Asynchronous copy (any direction) and zero fill, on `stream`.
void cuda_copy_async(void* destination, const void* source, std::size_t bytes, void* stream);
void cuda_zero_async(void* destination, std::size_t bytes, void* stream);

// y = a * x + b * y on the device (floating dtypes, same numel and dtype),
// computed in float (double for fp64) and rounded once per element.
void cuda_axpby(double a, const TensorView& x, double b, const TensorView& y, void* stream);

// diff (fp32) = low_precision_ring_diff(x, w, l, r) element-wise (x, w, l, r
// of one dtype and size), on the device.
void cuda_ring_diff(const TensorView& x, const TensorView& w, const TensorView& l,
                    const TensorView& r, const TensorView& diff, void* stream);

// to = from converted to to's dtype (same numel), on the device.
void cuda_convert(const TensorView& from, const TensorView& to, void* stream);

}  // namespace bagua
