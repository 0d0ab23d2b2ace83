// MinMaxUInt8 on the device: one block per chunk reduces min and max (and
// finiteness) in shared memory, then quantizes; decompression decodes (or
// accumulates) one element per thread. The per-element math is
// bagua/compression/minmax_uint8.h, shared with the CPU path, so the codes
// are the same bit for bit. Layout per chunk: [min f32][max f32][n codes].
#include <cuda_runtime.h>

#include <limits>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/dtype.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

namespace q = ::bagua::minmax_uint8;

template <typename T>
__global__ void compress_kernel(const T* x, std::int64_t numel, std::int64_t chunk_elements,
                                std::uint8_t* out) {
  __shared__ float mins[kThreads];
  __shared__ float maxs[kThreads];
  __shared__ int finite[kThreads];
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t begin = chunk * chunk_elements;
  const std::int64_t count = min(chunk_elements, numel - begin);
  std::uint8_t* header = out + chunk * (q::kHeaderBytes + chunk_elements);
  float lo = std::numeric_limits<float>::infinity();
  float hi = -std::numeric_limits<float>::infinity();
  int all_finite = 1;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float v = static_cast<float>(load(x[begin + i]));
    all_finite &= isfinite(v) ? 1 : 0;
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  mins[threadIdx.x] = lo;
  maxs[threadIdx.x] = hi;
  finite[threadIdx.x] = all_finite;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      mins[threadIdx.x] = fminf(mins[threadIdx.x], mins[threadIdx.x + stride]);
      maxs[threadIdx.x] = fmaxf(maxs[threadIdx.x], maxs[threadIdx.x + stride]);
      finite[threadIdx.x] &= finite[threadIdx.x + stride];
    }
    __syncthreads();
  }
  float chunk_min = count > 0 ? mins[0] : 0.0f;
  float chunk_max = count > 0 ? maxs[0] : 0.0f;
  if (!finite[0]) chunk_min = chunk_max = std::numeric_limits<float>::quiet_NaN();
  if (threadIdx.x == 0) {
    memcpy(header, &chunk_min, sizeof(float));
    memcpy(header + sizeof(float), &chunk_max, sizeof(float));
  }
  const q::Grid grid = q::make_grid(chunk_min, chunk_max);
  std::uint8_t* codes = header + q::kHeaderBytes;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    codes[i] = q::quantize(static_cast<float>(load(x[begin + i])), grid);
  }
}

template <typename T>
__global__ void decompress_kernel(const std::uint8_t* in, std::int64_t numel,
                                  std::int64_t chunk_elements, T* out, bool accumulate) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t begin = chunk * chunk_elements;
  const std::int64_t count = min(chunk_elements, numel - begin);
  const std::uint8_t* header = in + chunk * (q::kHeaderBytes + chunk_elements);
  float chunk_min;
  float chunk_max;
  memcpy(&chunk_min, header, sizeof(float));
  memcpy(&chunk_max, header + sizeof(float), sizeof(float));
  const q::Grid grid = q::make_grid(chunk_min, chunk_max);
  const std::uint8_t* codes = header + q::kHeaderBytes;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float decoded = q::dequantize(codes[i], grid);
    T& target = out[begin + i];
    target = accumulate ? store<T>(static_cast<compute_type_t<T>>(load(target) + decoded))
                        : store<T>(static_cast<compute_type_t<T>>(decoded));
  }
}

template <typename Launch>
const char* dispatch_float(int dtype, Launch&& launch) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch(float{}); break;
    case DType::kFloat16: launch(Half{}); break;
    case DType::kBFloat16: launch(BFloat16{}); break;
    case DType::kFloat64: launch(double{}); break;
    default: return "MinMaxUInt8 compresses floating point tensors only";
  }
  return last_launch_error();
}

}  // namespace

const char* minmax_uint8_compress(const void* x, std::int64_t numel, int dtype,
                                  std::int64_t chunk_elements, void* out, void* stream) noexcept {
  if (numel == 0) return nullptr;
  const auto chunks = static_cast<unsigned>((numel + chunk_elements - 1) / chunk_elements);
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    compress_kernel<T><<<chunks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), numel, chunk_elements, static_cast<std::uint8_t*>(out));
  });
}

const char* minmax_uint8_decompress(const void* in, std::int64_t numel, int dtype,
                                    std::int64_t chunk_elements, void* out, bool accumulate,
                                    void* stream) noexcept {
  if (numel == 0) return nullptr;
  const auto chunks = static_cast<unsigned>((numel + chunk_elements - 1) / chunk_elements);
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    decompress_kernel<T><<<chunks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const std::uint8_t*>(in), numel, chunk_elements, static_cast<T*>(out),
        accumulate);
  });
}

}  // namespace bagua::kernels
