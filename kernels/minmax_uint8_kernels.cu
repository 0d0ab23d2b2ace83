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
// Decompression is one kernel with the same slicing. Where a chunk's input
// is 16-byte aligned and its codes 8-byte aligned (the runtime's chunkings
// on its buffers), each thread moves groups of 8 consecutive elements with
// vector loads and stores, and 16-bit inputs convert with the hardware's
// instructions; other chunks take an element-wise loop with the same math.
// The encode kernel walks slices from the last to the first: the stats pass
// ended on the last ones, so they are still in L2. The per-element math is
// bagua/compression/minmax_uint8.h, shared with the CPU path, so the codes
// are the same bit for bit. Layout per chunk: [min f32][max f32][n codes].
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <type_traits>

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
// Resident blocks per SM the slice kernels are compiled for (registers capped
// at 65536 / (256 * 6) = 42 per thread): their blocks are short-lived, so
// occupancy is what hides the memory latency.
constexpr int kBlocksPerSM = 6;

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

// ---- groups of consecutive elements, for aligned chunks ------------------

// Elements per vector access: 16 bytes of input (4 fp32 or 8 16-bit values),
// so each warp-wide load or store covers one contiguous 512-byte span.
template <typename T>
constexpr int kGroup = std::is_same_v<T, float> ? 4 : 8;
// Groups each thread handles in a full slice.
template <typename T>
constexpr int kRounds = static_cast<int>(kSliceElements / (kGroup<T> * kThreads));
static_assert(kRounds<float> * kGroup<float> * kThreads == kSliceElements);
static_assert(kRounds<Half> * kGroup<Half> * kThreads == kSliceElements);
// Encode and decompress, which keep no per-slice partials, give each block a
// span of two slices of 16-bit input: the same 16 KB of input per block as
// fp32 (a block is short-lived, and each one pays a memory latency or two).
template <typename T>
constexpr std::int64_t kSpan = sizeof(T) == 2 ? 2 * kSliceElements : kSliceElements;
template <typename T>
constexpr int kSpanRounds = static_cast<int>(kSpan<T> / (kGroup<T> * kThreads));

template <typename T>
constexpr bool kGrouped = std::is_same_v<T, float> || is_half_type_v<T>;

// The hardware conversions. Exact for every non-NaN value, like the software
// ones of core/half.h; a NaN only ever makes its chunk non-finite, whatever
// its payload, so the codes stay the CPU's bit for bit.
__device__ inline float to_float_fast(Half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ inline float to_float_fast(BFloat16 b) {
  return __uint_as_float(static_cast<std::uint32_t>(b.bits) << 16);
}
// Out of line: the NaN case is rare, and inlined it costs registers.
__device__ __noinline__ std::uint16_t nan_bits(float f) { return Half::from_float(f); }
__device__ inline std::uint16_t bits_of(float f, Half) {
  if (isnan(f)) return nan_bits(f);  // the CPU's NaN, sign and quiet bit
  std::uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ inline std::uint16_t bits_of(float f, BFloat16) { return BFloat16::from_float(f); }

// A group as loaded, 16 bytes, converted to float only when used: a 16-bit
// group holds in 4 registers instead of 8 while the thread's loads fly.
template <typename T>
using Vec = std::conditional_t<std::is_same_v<T, float>, float4, uint4>;

template <typename T>
__device__ inline Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}

__device__ inline void unpack(float4 a, float (&v)[4]) {
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}
template <typename T16>
__device__ inline void unpack(uint4 w, float (&v)[8], T16) {
  const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // little-endian: the lower half is the first element
    T16 lo, hi;
    lo.bits = static_cast<std::uint16_t>(words[k] & 0xffffu);
    hi.bits = static_cast<std::uint16_t>(words[k] >> 16);
    v[2 * k] = to_float_fast(lo);
    v[2 * k + 1] = to_float_fast(hi);
  }
}

// The group's elements as floats.
template <typename T>
__device__ inline void unpack_group(Vec<T> raw, float (&v)[kGroup<T>]) {
  if constexpr (std::is_same_v<T, float>) {
    unpack(raw, v);
  } else {
    unpack(raw, v, T{});
  }
}
template <typename T>
__device__ inline void load_group(const T* p, float (&v)[kGroup<T>]) {
  unpack_group<T>(load_vec(p), v);
}

__device__ inline void store_group(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T16>
__device__ inline void store_group(T16* p, const float (&v)[8]) {
  std::uint32_t words[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    words[k] = bits_of(v[2 * k], T16{}) | static_cast<std::uint32_t>(bits_of(v[2 * k + 1], T16{}))
                                              << 16;
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// A group's codes as one word: 4 codes in a 32-bit one, 8 in a 64-bit one.
template <int G>
using CodeWord = std::conditional_t<G == 4, std::uint32_t, std::uint64_t>;

template <int G>
__device__ inline CodeWord<G> load_codes(const std::uint8_t* p) {
  return *reinterpret_cast<const CodeWord<G>*>(p);
}
template <int G>
__device__ inline std::uint8_t code_at(CodeWord<G> word, int k) {
  return static_cast<std::uint8_t>(word >> (8 * k));
}
template <int G>
__device__ inline void store_codes(std::uint8_t* p, const std::uint8_t (&c)[G]) {
  CodeWord<G> word = 0;
#pragma unroll
  for (int k = 0; k < G; ++k) word |= static_cast<CodeWord<G>>(c[k]) << (8 * k);
  *reinterpret_cast<CodeWord<G>*>(p) = word;
}

// Whether a chunk can take the grouped path: input on 16 bytes, codes on the
// size of a code word. Slices start at multiples of kSliceElements, so every
// group is aligned too.
template <typename T>
__device__ inline bool grouped_chunk(const T* input, const std::uint8_t* codes) {
  if constexpr (kGrouped<T>) {
    return reinterpret_cast<std::uintptr_t>(input) % 16 == 0 &&
           reinterpret_cast<std::uintptr_t>(codes) % kGroup<T> == 0;
  } else {
    return false;
  }
}

// Calls load(r, first) for each full group of [begin, end), at most
// Rounds * kThreads groups, that falls to this thread (round r, group's first
// element), then use(r, first) for the same
// groups, then single(i) for the elements after the last full group.
template <typename T, int Rounds, typename Load, typename Use, typename Single>
__device__ inline void for_slice_groups(std::int64_t begin, std::int64_t end, Load&& load,
                                        Use&& use, Single&& single) {
  constexpr int G = kGroup<T>;
  const std::int64_t groups = (end - begin) / G;
#pragma unroll
  for (int r = 0; r < Rounds; ++r) {
    const std::int64_t g = threadIdx.x + static_cast<std::int64_t>(r) * kThreads;
    if (g < groups) load(r, begin + g * G);
  }
#pragma unroll
  for (int r = 0; r < Rounds; ++r) {
    const std::int64_t g = threadIdx.x + static_cast<std::int64_t>(r) * kThreads;
    if (g < groups) use(r, begin + g * G);
  }
  for (std::int64_t i = begin + groups * G + threadIdx.x; i < end; i += kThreads) single(i);
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

// stats_of over [begin, end) of a grouped chunk, begin a slice's start.
template <typename T>
__device__ Partial grouped_stats_of(const T* x, std::int64_t begin, std::int64_t end) {
  Partial p{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 1};
  auto take = [&](float v) {
    p.finite &= isfinite(v) ? 1 : 0;
    p.lo = fminf(p.lo, v);
    p.hi = fmaxf(p.hi, v);
  };
  Vec<T> raw[kRounds<T>];
  for_slice_groups<T, kRounds<T>>(
      begin, end, [&](int r, std::int64_t first) { raw[r] = load_vec(x + first); },
      [&](int r, std::int64_t) {
        float v[kGroup<T>];
        unpack_group<T>(raw[r], v);
#pragma unroll
        for (int k = 0; k < kGroup<T>; ++k) take(v[k]);
      },
      [&](std::int64_t i) { take(static_cast<float>(load(x[i]))); });
  return p;
}

// stats_of, or grouped_stats_of where the chunk is grouped.
template <typename T>
__device__ Partial grouped_or_not(bool grouped, const T* x, std::int64_t begin, std::int64_t end) {
  if constexpr (kGrouped<T>) {
    if (grouped) return grouped_stats_of(x, begin, end);
  }
  return stats_of(x, begin, end);
}

// Grid: x = chunk, y strides over the chunk's slices.
template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
    slice_stats_kernel(const T* x, Chunking layout, std::uint8_t* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  if (count < kSmallChunk) return;
  const T* base = x + chunk * layout.chunk_elements;
  const bool grouped = grouped_chunk(base, layout.header(out, chunk) + q::kHeaderBytes);
  for (std::int64_t slice = blockIdx.y; slice < layout.slices(count); slice += gridDim.y) {
    const std::int64_t begin = slice * kSliceElements;
    const std::int64_t end = min(count, begin + kSliceElements);
    const Partial p = block_reduce(grouped_or_not(grouped, base, begin, end));
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

// Grid: x = chunk, y strides over the chunk's spans.
template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
    encode_kernel(const T* x, Chunking layout, std::uint8_t* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  const T* base = x + chunk * layout.chunk_elements;
  std::uint8_t* header = layout.header(out, chunk);
  const q::Grid grid = grid_of(header);
  std::uint8_t* codes = header + q::kHeaderBytes;
  const bool grouped = grouped_chunk(base, codes);
  const std::int64_t spans = (count + kSpan<T> - 1) / kSpan<T>;
  for (std::int64_t s = blockIdx.y; s < spans; s += gridDim.y) {
    const std::int64_t span = spans - 1 - s;  // last first: those are still in L2
    const std::int64_t begin = span * kSpan<T>;
    const std::int64_t end = min(count, begin + kSpan<T>);
    if constexpr (kGrouped<T>) {
      if (grouped) {
        Vec<T> raw[kSpanRounds<T>];
        for_slice_groups<T, kSpanRounds<T>>(
            begin, end, [&](int r, std::int64_t first) { raw[r] = load_vec(base + first); },
            [&](int r, std::int64_t first) {
              float v[kGroup<T>];
              unpack_group<T>(raw[r], v);
              std::uint8_t c[kGroup<T>];
#pragma unroll
              for (int k = 0; k < kGroup<T>; ++k) c[k] = q::quantize(v[k], grid);
              store_codes<kGroup<T>>(codes + first, c);
            },
            [&](std::int64_t i) {
              codes[i] = q::quantize(static_cast<float>(load(base[i])), grid);
            });
        continue;
      }
    }
    for_slice<kUnroll<T>>(begin, end, [&](std::int64_t first, std::int64_t stride, int k) {
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

// decoded, or the element it is added to plus decoded, in T.
template <typename T, bool Accumulate>
__device__ inline T decoded_element(const T* target, float decoded) {
  if constexpr (Accumulate) {
    return store<T>(static_cast<compute_type_t<T>>(load(*target) + decoded));
  } else {
    return store<T>(static_cast<compute_type_t<T>>(decoded));
  }
}

// The grouped path of decompress_kernel over one span. The codes of all the
// thread's groups are loaded first (a word each); the elements accumulated
// onto are loaded one group at a time, which keeps the kernel at ~40
// registers: occupancy, not a deep pipeline, hides the latency.
template <typename T, bool Accumulate>
__device__ inline void decompress_groups(const std::uint8_t* codes, const q::Grid& grid, T* base,
                                         std::int64_t begin, std::int64_t end) {
  constexpr int G = kGroup<T>;
  CodeWord<G> words[kSpanRounds<T>];
  for_slice_groups<T, kSpanRounds<T>>(
      begin, end, [&](int r, std::int64_t first) { words[r] = load_codes<G>(codes + first); },
      [&](int r, std::int64_t first) {
        float decoded[G];
        if constexpr (Accumulate) load_group(base + first, decoded);
#pragma unroll
        for (int k = 0; k < G; ++k) {
          const float value = q::dequantize(code_at<G>(words[r], k), grid);
          decoded[k] = Accumulate ? decoded[k] + value : value;
        }
        store_group(base + first, decoded);
      },
      [&](std::int64_t i) {
        base[i] = decoded_element<T, Accumulate>(base + i, q::dequantize(codes[i], grid));
      });
}

// Grid as encode_kernel's.
template <typename T, bool Accumulate>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
    decompress_kernel(const std::uint8_t* in, Chunking layout, T* out) {
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t count = layout.count(chunk);
  const std::uint8_t* header = layout.header(const_cast<std::uint8_t*>(in), chunk);
  const q::Grid grid = grid_of(header);
  const std::uint8_t* codes = header + q::kHeaderBytes;
  T* base = out + chunk * layout.chunk_elements;
  const bool grouped = grouped_chunk<T>(base, codes);
  const std::int64_t spans = (count + kSpan<T> - 1) / kSpan<T>;
  for (std::int64_t span = blockIdx.y; span < spans; span += gridDim.y) {
    const std::int64_t begin = span * kSpan<T>;
    const std::int64_t end = min(count, begin + kSpan<T>);
    if constexpr (kGrouped<T>) {
      if (grouped) {
        decompress_groups<T, Accumulate>(codes, grid, base, begin, end);
        continue;
      }
    }
    for_slice<4>(begin, end, [&](std::int64_t first, std::int64_t stride, int k) {
      std::uint8_t code[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (u < k) code[u] = codes[first + u * stride];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (u < k) {
          T* target = base + first + u * stride;
          *target = decoded_element<T, Accumulate>(target, q::dequantize(code[u], grid));
        }
      }
    });
  }
}

// (chunks, pieces of `piece` elements in a full chunk) as a launch grid:
// chunks on x (up to 2^31 - 1), pieces on y (the kernels stride when a chunk
// has more). Pieces are slices for the stats, spans for encode and decompress.
dim3 slice_grid(std::int64_t numel, std::int64_t chunk_elements, std::int64_t piece) {
  const std::int64_t chunks = (numel + chunk_elements - 1) / chunk_elements;
  const std::int64_t slices = (std::min(chunk_elements, numel) + piece - 1) / piece;
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
  const Chunking layout{numel, chunk_elements};
  auto* packed = static_cast<std::uint8_t*>(out);
  const auto s = static_cast<cudaStream_t>(stream);
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* input = static_cast<const T*>(x);
    const dim3 slices = slice_grid(numel, chunk_elements, kSliceElements);
    slice_stats_kernel<T><<<slices, kThreads, 0, s>>>(input, layout, packed);
    chunk_header_kernel<T><<<slices.x, kThreads, 0, s>>>(input, layout, packed);
    encode_kernel<T>
        <<<slice_grid(numel, chunk_elements, kSpan<T>), kThreads, 0, s>>>(input, layout, packed);
  });
}

const char* minmax_uint8_decompress(const void* in, std::int64_t numel, int dtype,
                                    std::int64_t chunk_elements, void* out, bool accumulate,
                                    void* stream) noexcept {
  if (numel == 0) return nullptr;
  if (chunk_elements <= 0) return "minmax_uint8_decompress: chunk_elements must be positive";
  return dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid = slice_grid(numel, chunk_elements, kSpan<T>);
    const auto* packed = static_cast<const std::uint8_t*>(in);
    const Chunking layout{numel, chunk_elements};
    const auto s = static_cast<cudaStream_t>(stream);
    if (accumulate) {
      decompress_kernel<T, true><<<grid, kThreads, 0, s>>>(packed, layout, static_cast<T*>(out));
    } else {
      decompress_kernel<T, false><<<grid, kThreads, 0, s>>>(packed, layout, static_cast<T*>(out));
    }
  });
}

}  // namespace bagua::kernels
