// CudaCompute: Compute on a GPU, the kernels of kernels/ enqueued on one
// stream of one device (lib/runtime/cuda_compute.cc), and the checked
// wrappers of those kernels on a stream of the caller's, which Python's GPU
// tests call directly.
//
// Every wrapper throws InvalidArgument for host tensors (and, in a build
// without CUDA, for anything: lib/runtime/cuda_compute_absent.cc) and
// BackendError when the launch fails. `stream` is a cudaStream_t; nullptr is
// the legacy default stream. Nothing here waits for the device.
#pragma once

#include <cstdint>
#include <memory>

#include "bagua/core/tensor_view.h"
#include "bagua/runtime/compute.h"

namespace bagua {

// The kernels on `stream` of `device`, by default (nullptr) the device's
// communication stream. A compute on another stream must finish() its work
// before its scratch blocks go back to the pool.
std::unique_ptr<Compute> make_cuda_compute(int device, void* stream = nullptr);

// x /= divisor on the device.
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

// out = a (op) b element-wise on the device (kAvg adds), the ring step of the
// NCCL P-Reduce; the math of reduce_into (bagua/core/elementwise.h).
void cuda_pairwise_reduce(ReduceOp op, const TensorView& out, const TensorView& a,
                          const TensorView& b, void* stream);

}  // namespace bagua
