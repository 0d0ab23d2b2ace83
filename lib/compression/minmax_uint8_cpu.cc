// The fp32 MinMaxUInt8 compressor and decompressor of the CPU path: AVX2
// versions picked at run time when the CPU has it, and the portable loops
// otherwise. Both apply minmax_uint8.h's formulas in the same IEEE operations
// (multiply, round to nearest even, subtract, clamp; add, divide), so codes
// and decoded values are identical bit for bit; tests/cpp/test_compression.cc
// checks it. (The decoder divides by the scale, as the formula does, rather
// than multiplying by its reciprocal, which would change the last bit.)
#include <cstring>

#include "bagua/compression/minmax_uint8.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BAGUA_HAVE_AVX2_PATH 1
#endif

namespace bagua::minmax_uint8 {
namespace {

void compress_portable(const float* x, std::int64_t count, std::byte* out) {
  compress<float>(x, count, out);
}

#if defined(BAGUA_HAVE_AVX2_PATH)

__attribute__((target("avx2"))) void statistics_avx2(const float* x, std::int64_t count, float& min,
                                                     float& max, bool& finite) {
  min = max = x[0];
  __m256 mins = _mm256_set1_ps(min);
  __m256 maxs = mins;
  __m256i special = _mm256_setzero_si256();
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  std::int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    // min_ps(v, m) is v < m ? v : m: the scalar formula lane by lane.
    mins = _mm256_min_ps(v, mins);
    maxs = _mm256_max_ps(v, maxs);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), exponent);
    special = _mm256_or_si256(special, _mm256_cmpeq_epi32(bits, exponent));
  }
  alignas(32) float lane_min[8];
  alignas(32) float lane_max[8];
  _mm256_store_ps(lane_min, mins);
  _mm256_store_ps(lane_max, maxs);
  bool any_special = !_mm256_testz_si256(special, special);
  for (int l = 0; l < 8; ++l) {
    min = lane_min[l] < min ? lane_min[l] : min;
    max = lane_max[l] > max ? lane_max[l] : max;
  }
  for (; i < count; ++i) {
    const float v = x[i];
    any_special = any_special || !(v - v == 0.0f);
    min = v < min ? v : min;
    max = v > max ? v : max;
  }
  finite = !any_special;
}

__attribute__((target("avx2"))) void quantize_avx2(const float* x, std::int64_t count, float scale,
                                                   float lower, std::uint8_t* codes) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 vlower = _mm256_set1_ps(lower);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 top = _mm256_set1_ps(255.0f);
  // The 32-bit lanes in order after packs_epi32/packus_epi16 interleave halves.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  std::int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      __m256 code = _mm256_sub_ps(
          _mm256_round_ps(
              _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * static_cast<std::int64_t>(k)), vscale),
              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          vlower);
      code = _mm256_min_ps(_mm256_max_ps(code, zero), top);
      q[k] = _mm256_cvttps_epi32(code);
    }
    const __m256i words01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i words23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_packus_epi16(words01, words23);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; i < count; ++i) codes[i] = quantize_regular(x[i], scale, lower);
}

__attribute__((target("avx2"))) void compress_avx2(const float* x, std::int64_t count,
                                                   std::byte* out) {
  if (count == 0) {
    compress_portable(x, count, out);
    return;
  }
  float min = 0.0f;
  float max = 0.0f;
  bool finite = true;
  statistics_avx2(x, count, min, max, finite);
  const Grid grid = write_header(min, max, finite, out);
  auto* codes = reinterpret_cast<std::uint8_t*>(out + kHeaderBytes);
  if (grid.constant || grid.non_finite) {
    std::memset(codes, 0, static_cast<std::size_t>(count));
    return;
  }
  quantize_avx2(x, count, grid.scale, grid.lower, codes);
}

// out[i] = (q[i] + lower) / scale, plus out[i] first when accumulating: the
// float addition commutes exactly, so lanes equal dequantize()'s result.
__attribute__((target("avx2"))) void decode_regular_avx2(const std::uint8_t* codes,
                                                         std::int64_t count, float scale,
                                                         float lower, float* out, bool accumulate) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 vlower = _mm256_set1_ps(lower);
  std::int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    const __m256 level = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), vlower);
    __m256 decoded = _mm256_div_ps(level, vscale);
    if (accumulate) decoded = _mm256_add_ps(_mm256_loadu_ps(out + i), decoded);
    _mm256_storeu_ps(out + i, decoded);
  }
  for (; i < count; ++i) {
    const float decoded = (static_cast<float>(codes[i]) + lower) / scale;
    out[i] = accumulate ? out[i] + decoded : decoded;
  }
}

__attribute__((target("avx2"))) void decompress_avx2(const std::byte* in, std::int64_t count,
                                                     float* out, bool accumulate) {
  const Grid grid = read_grid(in);
  if (grid.constant || grid.non_finite) {  // rare: the portable loop's rules
    decompress<float>(in, count, out, accumulate);
    return;
  }
  decode_regular_avx2(reinterpret_cast<const std::uint8_t*>(in + kHeaderBytes), count, grid.scale,
                      grid.lower, out, accumulate);
}

#endif  // BAGUA_HAVE_AVX2_PATH

void decompress_portable(const std::byte* in, std::int64_t count, float* out, bool accumulate) {
  decompress<float>(in, count, out, accumulate);
}

using DecompressFn = void (*)(const std::byte*, std::int64_t, float*, bool);

DecompressFn pick_decompressor() {
#if defined(BAGUA_HAVE_AVX2_PATH)
  if (__builtin_cpu_supports("avx2")) return &decompress_avx2;
#endif
  return &decompress_portable;
}

using CompressFn = void (*)(const float*, std::int64_t, std::byte*);

CompressFn pick_compressor() {
#if defined(BAGUA_HAVE_AVX2_PATH)
  if (__builtin_cpu_supports("avx2")) return &compress_avx2;
#endif
  return &compress_portable;
}

}  // namespace

void compress_f32(const float* x, std::int64_t count, std::byte* out) {
  static const CompressFn compressor = pick_compressor();
  compressor(x, count, out);
}

void compress_f32_portable(const float* x, std::int64_t count, std::byte* out) {
  compress_portable(x, count, out);
}

void decompress_f32(const std::byte* in, std::int64_t count, float* out, bool accumulate) {
  static const DecompressFn decompressor = pick_decompressor();
  decompressor(in, count, out, accumulate);
}

void decompress_f32_portable(const std::byte* in, std::int64_t count, float* out, bool accumulate) {
  decompress_portable(in, count, out, accumulate);
}

}  // namespace bagua::minmax_uint8
