// MinMaxUInt8 on the device. A chunk's launch shape is decoupled from the
// wire format's chunking: every chunk is cut into slices of kSliceElements,
// one block per slice, so a 25 MB bucket keeps every SM busy whatever the
// number of chunks (C_LP_S uses one chunk per rank). Compression is three
// kernels on one stream:
//   1. slice_stats: each block reduces min, max and finiteness of its slice
//      and parks the partial in the chunk's own code bytes (not written yet);
//   2. chunk_header: one block per chunk reduces the partials and writes the
//      header (chunks under kSmallChunk elements, with no room for partials,
//      are reduced here directly from the input);
//   3. encode: one block per slice quantizes against the header, overwriting
//      the partials.
// Decompression is one kernel with the same slicing. The per-element math is
// bagua/compression/minmax_uint8.h, shared with the CPU path, so the codes
// are the same bit for bit. Layout per chunk: [min f32][max f32][n codes].
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/dtype.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

namespace q = ::bagua::minmax_uint8;

constexpr std::int64_t kSliceElements = 4096;  // elements per block (16 per thread)
constexpr std::int64_t kSmallChunk = 16;       // below: no room for the partials
constexpr unsigned kMaxGridY = 65535;

struct Partial {  // min, max and finiteness of one slice
  float lo;
  float hi;
  int finite;
};

struct Chunking {
  std::int64_t numel;
  std::int64_t chunk_elements;

  __device__ std::int64_t count(std::int64_t chunk) const {
    return min(chunk_elements, numel - chunk * chunk_elements);
  }
  __device__ std::int64_t slices(std::int64_t count) const {
    return (count + kSliceElements - 1) / kSliceElements;
  }
  __device__ std::uint8_t* header(std::uint8_t* out, std::int64_t chunk) const {
    return out + chunk * static_cast<std::int64_t>(q::kHeaderBytes + chunk_elements);
  }
  // The partials of a chunk: 4-byte aligned inside its code bytes, which hold
  // count >= kSmallChunk bytes, enough for 3 + 12 * slices(count).
  __device__ Partial* partials(std::uint8_t* out, std::int64_t chunk) const {
    const auto codes = reinterpret_cast<std::uintptr_t>(header(out, chunk) + q::kHeaderBytes);
    return reinterpret_cast<Partial*>((codes + 3) & ~std::uintptr_t{3});
  }
};

__device__ inline Partial combine_partials(Partial a, Partial b) {
  return {fminf(a.lo, b.lo), fmaxf(a.hi, b.hi), a.finite & b.finite};
}

// The combination of every thread's partial, valid in thread 0.
__device__ Partial block_reduce(Partial p) {
  __shared__ Partial warps[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    p = combine_partials(p, {__shfl_down_sync(0xffffffffu, p.lo, offset),
                             __shfl_down_sync(0xffffffffu, p.hi, offset),
                             __shfl_down_sync(0xffffffffu, p.finite, offset)});
  }
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = p;
  __syncthreads();
  if (threadIdx.x < 32) {
    p = threadIdx.x < kThreads / 32 ? warps[threadIdx.x]
                                    : Partial{std::numeric_limits<float>::infinity(),
                                              -std::numeric_limits<float>::infinity(), 1};
    for (int offset = 16; offset > 0; offset /= 2) {
      p = combine_partials(p, {__shfl_down_sync(0xffffffffu, p.lo, offset),
                               __shfl_down_sync(0xffffffffu, p.hi, offset),
                               __shfl_down_sync(0xffffffffu, p.finite, offset)});
    }
  }
  return p;
}

// Elements each thread loads before it uses any: more for 16-bit inputs,
// whose loads bring half the bytes.
template <typename T>
constexpr int kUnroll = sizeof(T) < 4 ? 8 : 4;

// Calls body(first, stride, k) for this thread's elements of [begin, end):
// rounds of k = Unroll elements first, first + stride, ..., then single
// ones (k = 1). Bodies load their k inputs before computing, so each thread
// has Unroll loads in flight (the compiler may not move a load above a
// store to a uint8_t*, which may alias it).
template <int Unroll, typename Body>
__device__ inline void for_slice(std::int64_t begin, std::int64_t end, Body&& body) {
  const std::int64_t stride = blockDim.x;
  std::int64_t i = begin + threadIdx.x;
  for (; i + (Unroll - 1) * stride < end; i += Unroll * stride) body(i, stride, Unroll);
  for (; i < end; i += stride) body(i, stride, 1);
}

template <typename T>
__device__ Partial stats_of(const T* x, std::int64_t begin, std::int64_t end) {
  Partial p{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 1};
  for_slice<kUnroll<T>>(begin, end, [&](std::int64_t first, std::int64_t stride, int k) {
    float v[kUnroll<T>];
#pragma unroll
    for (int u = 0; u < kUnroll<T>; ++u) {
      if (u < k) v[u] = static_cast<float>(load(x[first + u * stride]));
    }
#pragma unroll
    for (int u = 0; u < kUnroll<T>; ++u) {
      if (u < k) {
        p.finite &= isfinite(v[u]) ? 1 : 0;
        p.lo = fminf(p.lo, v[u]);
        p.hi = fmaxf(p.hi, v[u]);
      }
    }
  });
  return p;
}

// Grid: x = chunk, y strides over the chunk's slices.
template <typename T>
__global__ void slice_stats_kernel(const T* x, Chunking layout, std::uint8_t* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  if (count < kSmallChunk) return;
  const T* base = x + chunk * layout.chunk_elements;
  for (std::int64_t slice = blockIdx.y; slice < layout.slices(count); slice += gridDim.y) {
    const std::int64_t begin = slice * kSliceElements;
    const Partial p = block_reduce(stats_of(base, begin, min(count, begin + kSliceElements)));
    if (threadIdx.x == 0) layout.partials(out, chunk)[slice] = p;
    __syncthreads();  // block_reduce's shared memory is reused by the next slice
  }
}

// One block per chunk.
template <typename T>
__global__ void chunk_header_kernel(const T* x, Chunking layout, std::uint8_t* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  Partial p{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 1};
  if (count < kSmallChunk) {
    p = stats_of(x + chunk * layout.chunk_elements, 0, count);
  } else {
    const Partial* partials = layout.partials(out, chunk);
    for (std::int64_t s = threadIdx.x; s < layout.slices(count); s += blockDim.x) {
      p = combine_partials(p, partials[s]);
    }
  }
  p = block_reduce(p);
  if (threadIdx.x != 0) return;
  float chunk_min = count > 0 ? p.lo : 0.0f;
  float chunk_max = count > 0 ? p.hi : 0.0f;
  if (!p.finite) chunk_min = chunk_max = std::numeric_limits<float>::quiet_NaN();
  std::uint8_t* header = layout.header(out, chunk);
  memcpy(header, &chunk_min, sizeof(float));
  memcpy(header + sizeof(float), &chunk_max, sizeof(float));
}

__device__ inline q::Grid grid_of(const std::uint8_t* header) {
  float chunk_min;
  float chunk_max;
  memcpy(&chunk_min, header, sizeof(float));
  memcpy(&chunk_max, header + sizeof(float), sizeof(float));
  return q::make_grid(chunk_min, chunk_max);
}

// Grid as slice_stats_kernel's.
template <typename T>
__global__ void encode_kernel(const T* x, Chunking layout, std::uint8_t* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  const T* base = x + chunk * layout.chunk_elements;
  std::uint8_t* header = layout.header(out, chunk);
  const q::Grid grid = grid_of(header);
  std::uint8_t* codes = header + q::kHeaderBytes;
  for (std::int64_t slice = blockIdx.y; slice < layout.slices(count); slice += gridDim.y) {
    const std::int64_t end = min(count, (slice + 1) * kSliceElements);
    for_slice<kUnroll<T>>(slice * kSliceElements, end,
                          [&](std::int64_t first, std::int64_t stride, int k) {
                            float v[kUnroll<T>];
#pragma unroll
                            for (int u = 0; u < kUnroll<T>; ++u) {
                              if (u < k) v[u] = static_cast<float>(load(base[first + u * stride]));
                            }
#pragma unroll
                            for (int u = 0; u < kUnroll<T>; ++u) {
                              if (u < k) codes[first + u * stride] = q::quantize(v[u], grid);
                            }
                          });
  }
}

// Grid as slice_stats_kernel's.
template <typename T>
__global__ void decompress_kernel(const std::uint8_t* in, Chunking layout, T* out,
                                  bool accumulate) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  const std::uint8_t* header = layout.header(const_cast<std::uint8_t*>(in), chunk);
  const q::Grid grid = grid_of(header);
  const std::uint8_t* codes = header + q::kHeaderBytes;
  T* base = out + chunk * layout.chunk_elements;
  for (std::int64_t slice = blockIdx.y; slice < layout.slices(count); slice += gridDim.y) {
    const std::int64_t end = min(count, (slice + 1) * kSliceElements);
    for_slice<kUnroll<T>>(
        slice * kSliceElements, end, [&](std::int64_t first, std::int64_t stride, int k) {
          std::uint8_t code[kUnroll<T>];
          compute_type_t<T> previous[kUnroll<T>] = {};
#pragma unroll
          for (int u = 0; u < kUnroll<T>; ++u) {
            if (u < k) {
              code[u] = codes[first + u * stride];
              if (accumulate) previous[u] = load(base[first + u * stride]);
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll<T>; ++u) {
            if (u < k) {
              const float decoded = q::dequantize(code[u], grid);
              base[first + u * stride] =
                  accumulate ? store<T>(static_cast<compute_type_t<T>>(previous[u] + decoded))
                             : store<T>(static_cast<compute_type_t<T>>(decoded));
            }
          }
        });
  }
}

// (chunks, slices of a full chunk) as a launch grid; chunks on x (up to
// 2^31 - 1), slices on y (the kernels stride when a chunk has more).
dim3 slice_grid(std::int64_t numel, std::int64_t chunk_elements) {
  const std::int64_t chunks = (numel + chunk_elements - 1) / chunk_elements;
  const std::int64_t slices =
      (std::min(chunk_elements, numel) + kSliceElements - 1) / kSliceElements;
  return dim3(static_cast<unsigned>(chunks),
              static_cast<unsigned>(std::min<std::int64_t>(slices, kMaxGridY)));
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
  if (chunk_elements <= 0) return "minmax_uint8_compress: chunk_elements must be positive";
  const dim3 grid = slice_grid(numel, chunk_elements);
  const Chunking layout{numel, chunk_elements};
  auto* packed = static_cast<std::uint8_t*>(out);
  const auto s = static_cast<cudaStream_t>(stream);
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* input = static_cast<const T*>(x);
    slice_stats_kernel<T><<<grid, kThreads, 0, s>>>(input, layout, packed);
    chunk_header_kernel<T><<<grid.x, kThreads, 0, s>>>(input, layout, packed);
    encode_kernel<T><<<grid, kThreads, 0, s>>>(input, layout, packed);
  });
}

const char* minmax_uint8_decompress(const void* in, std::int64_t numel, int dtype,
                                    std::int64_t chunk_elements, void* out, bool accumulate,
                                    void* stream) noexcept {
  if (numel == 0) return nullptr;
  if (chunk_elements <= 0) return "minmax_uint8_decompress: chunk_elements must be positive";
  const dim3 grid = slice_grid(numel, chunk_elements);
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    decompress_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const std::uint8_t*>(in), Chunking{numel, chunk_elements}, static_cast<T*>(out),
        accumulate);
  });
}

}  // namespace bagua::kernels
