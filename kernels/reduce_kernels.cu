// The chunked reduce on the device, with the element math of the CPU path
// (bagua/core/element_math.h): out[i] = sum over j of chunks[j][i], divided
// by the number of chunks for a mean (the local step of the scatter-reduce).
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

}  // namespace bagua::kernels
