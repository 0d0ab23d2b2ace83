// Reductions on the device, with the element math of the CPU path
// (bagua/core/element_math.h):
// - chunked_reduce: out[i] = sum over j of chunks[j][i], divided by the number
//   of chunks for a mean (the local step of the scatter-reduce);
// - pairwise_reduce: out[i] = a[i] (op) b[i], a ring step's reduction.
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
  for_each_index(chunk_elements, [&](std::int64_t i) {
    compute_type_t<T> acc = load(chunks[i]);
    for (std::int64_t j = 1; j < chunk_count; ++j) {
      acc = combine<T>(ReduceOp::kSum, acc, load(chunks[j * chunk_elements + i]));
    }
    out[i] = mean ? divide_one(store<T>(acc), chunk_count) : store<T>(acc);
  });
}

template <typename T>
__global__ void pairwise_reduce_kernel(T* out, const T* a, const T* b, std::int64_t count,
                                       ReduceOp op) {
  for_each_index(
      count, [&](std::int64_t i) { out[i] = store<T>(combine<T>(op, load(a[i]), load(b[i]))); });
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

const char* pairwise_reduce(void* out, const void* a, const void* b, std::int64_t numel, int dtype,
                            int op, void* stream) noexcept {
  if (numel == 0) return nullptr;
  return launch_for_type(dtype, "pairwise_reduce: unknown dtype", [&](auto tag) {
    using T = decltype(tag);
    pairwise_reduce_kernel<T>
        <<<blocks_for(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), numel,
            static_cast<ReduceOp>(op));
  });
}

}  // namespace bagua::kernels
