// Reductions on the device, with the element math of the CPU path
// (bagua/core/element_math.h):
// - chunked reduce: out[i] = sum over j of chunks[j][i] (divided by the
//   number of chunks for a mean), the local step of the scatter-reduce;
// - asynchronous model average update: w = w + sum / n - snapshot.
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

template <typename T>
__global__ void chunked_reduce_kernel(const T* chunks, std::int64_t chunk_count,
                                      std::int64_t chunk_elements, bool mean, T* out) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < chunk_elements; i += stride) {
    compute_type_t<T> acc = load(chunks[i]);
    for (std::int64_t j = 1; j < chunk_count; ++j) {
      acc = combine<T>(ReduceOp::kSum, acc, load(chunks[j * chunk_elements + i]));
    }
    out[i] = mean ? divide_one(store<T>(acc), chunk_count) : store<T>(acc);
  }
}

template <typename T>
__global__ void async_update_kernel(T* w, const T* sum, const T* snapshot, std::int64_t count,
                                    std::int64_t ranks) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    w[i] = ::bagua::async_average_update(w[i], sum[i], snapshot[i], ranks);
  }
}

}  // namespace

const char* chunked_reduce(const void* chunks, std::int64_t chunk_count,
                           std::int64_t chunk_elements, int dtype, bool mean, void* out,
                           void* stream) noexcept {
  if (chunk_elements == 0 || chunk_count == 0) return nullptr;
  return launch_for_type(dtype, "chunked_reduce: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    chunked_reduce_kernel<T>
        <<<blocks_for(chunk_elements), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(chunks), chunk_count, chunk_elements, mean, static_cast<T*>(out));
  });
}

const char* async_average_update(void* w, const void* sum, const void* snapshot, std::int64_t numel,
                                 std::int64_t ranks, int dtype, void* stream) noexcept {
  if (numel == 0) return nullptr;
  return launch_for_type(dtype, "async_average_update: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    async_update_kernel<T><<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(w), static_cast<const T*>(sum), static_cast<const T*>(snapshot), numel,
        ranks);
  });
}

int synchronize_device() noexcept { return cudaDeviceSynchronize() == cudaSuccess ? 0 : 1; }

int pinned_alloc(void** pointer, std::size_t bytes) noexcept {
  return cudaMallocHost(pointer, bytes) == cudaSuccess ? 0 : 1;
}

void pinned_free(void* pointer) noexcept { cudaFreeHost(pointer); }

int copy(void* destination, const void* source, std::size_t bytes) noexcept {
  return cudaMemcpy(destination, source, bytes, cudaMemcpyDefault) == cudaSuccess ? 0 : 1;
}

}  // namespace bagua::kernels
