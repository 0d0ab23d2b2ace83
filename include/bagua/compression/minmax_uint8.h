// MinMaxUInt8: 8-bit quantization of a chunk of floats between its min and
// max. The per-element math is written once, as BAGUA_HOST_DEVICE functions,
// and used by the CPU loops below and by the CUDA kernels in kernels/.
//
// Byte layout of one compressed chunk of n elements (docs/compression.md):
//   bytes [0, 4)      min, float32 (native byte order)
//   bytes [4, 8)      max, float32
//   bytes [8, 8 + n)  codes, uint8
// Encoding (the Bagua formulas):
//   scale = 255 / (max - min + 1e-7); upper = rint(max * scale); lower = upper - 255
//   q = uint8(clamp(rint(x * scale) - lower, 0, 255));  x' = (q + lower) / scale
// so |x - x'| <= (max - min) / 255 / 2 plus float rounding (measured: at most
// 1.7 * max|x| * 2^-24 more, which matters only when max|x| >> max - min).
// Special cases (a rule, tested):
//   - constant chunk (max == min): codes are 0 and every element decodes to
//     exactly min;
//   - any NaN or +-Inf in the chunk: the header stores NaN for min and max and
//     the whole chunk decodes to NaN, so a non-finite gradient is never hidden
//     (loss scalers see it and skip the step), the chunk being the unit;
//   - n == 0: header only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bagua/core/element_math.h"
#include "bagua/core/host_device.h"

namespace bagua::minmax_uint8 {

constexpr std::size_t kHeaderBytes = 2 * sizeof(float);

BAGUA_HOST_DEVICE constexpr std::size_t compressed_bytes(std::int64_t count) {
  return kHeaderBytes + static_cast<std::size_t>(count);
}

// The quantization grid of one chunk.
struct Grid {
  float min = 0.0f;
  float max = 0.0f;
  float scale = 0.0f;
  float upper = 0.0f;
  float lower = 0.0f;
  bool constant = false;
  bool non_finite = false;
};

BAGUA_HOST_DEVICE inline Grid make_grid(float min, float max) {
  Grid grid;
  grid.min = min;
  grid.max = max;
  // NaN compares false everywhere: test finiteness of the header explicitly.
  grid.non_finite = !(min - min == 0.0f) || !(max - max == 0.0f);
  grid.constant = !grid.non_finite && max == min;
  if (!grid.non_finite && !grid.constant) {
    grid.scale = 255.0f / (max - min + 1e-7f);
    grid.upper = rintf(max * grid.scale);
    grid.lower = grid.upper - 255.0f;
  }
  return grid;
}

// The code of x on a regular grid (not constant, finite): branch-free so the
// CPU loops vectorize. Clamping the code (not only the level) keeps it in
// [0, 255] also when |x| * scale passes 2^24 and upper - lower is no longer
// exactly 255 in float; the error then grows by float rounding only.
BAGUA_HOST_DEVICE inline std::uint8_t quantize_regular(float x, float scale, float lower) {
  float code = rintf(x * scale) - lower;
  code = code < 0.0f ? 0.0f : code;
  code = code > 255.0f ? 255.0f : code;
  // Through int32: a float -> uint8 conversion does not vectorize on x86.
  return static_cast<std::uint8_t>(static_cast<std::int32_t>(code));
}

BAGUA_HOST_DEVICE inline std::uint8_t quantize(float x, const Grid& grid) {
  if (grid.constant || grid.non_finite) return 0;
  return quantize_regular(x, grid.scale, grid.lower);
}

BAGUA_HOST_DEVICE inline float dequantize(std::uint8_t q, const Grid& grid) {
  if (grid.non_finite) return std::numeric_limits<float>::quiet_NaN();
  if (grid.constant) return grid.min;
  return (static_cast<float>(q) + grid.lower) / grid.scale;
}

// ---- CPU path ---------------------------------------------------------------

// Writes the header of a chunk with the given statistics and returns its grid.
inline Grid write_header(float min, float max, bool finite, std::byte* out) {
  if (!finite) min = max = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(out, &min, sizeof(float));
  std::memcpy(out + sizeof(float), &max, sizeof(float));
  return make_grid(min, max);
}

// Writes the compressed form of x[0, count) to `out` (compressed_bytes(count)).
// (fp32 goes through the vectorized compress_f32, with the same codes.)
template <typename T>
void compress(const T* x, std::int64_t count, std::byte* out) {
  float min = 0.0f;
  float max = 0.0f;
  float probe = 0.0f;  // x - x is NaN exactly for NaN and +-Inf
  if (count > 0) min = max = static_cast<float>(load(x[0]));
  for (std::int64_t i = 0; i < count; ++i) {
    const float v = static_cast<float>(load(x[i]));
    probe += v - v;
    min = v < min ? v : min;
    max = v > max ? v : max;
  }
  const Grid grid = write_header(min, max, probe == 0.0f, out);
  auto* codes = reinterpret_cast<std::uint8_t*>(out + kHeaderBytes);
  if (grid.constant || grid.non_finite) {
    std::memset(codes, 0, static_cast<std::size_t>(count));
    return;
  }
  for (std::int64_t i = 0; i < count; ++i) {
    codes[i] = quantize_regular(static_cast<float>(load(x[i])), grid.scale, grid.lower);
  }
}

// The fp32 CPU path: AVX2 when the CPU has it, else compress<float>; the
// same codes either way (lib/compression/minmax_uint8_cpu.cc).
void compress_f32(const float* x, std::int64_t count, std::byte* out);
// The portable loop alone, for tests comparing the two.
void compress_f32_portable(const float* x, std::int64_t count, std::byte* out);

inline Grid read_grid(const std::byte* in) {
  float min = 0.0f;
  float max = 0.0f;
  std::memcpy(&min, in, sizeof(float));
  std::memcpy(&max, in + sizeof(float), sizeof(float));
  return make_grid(min, max);
}

// out[i] = decoded element i (accumulate == false) or out[i] += it (true).
template <typename T>
void decompress(const std::byte* in, std::int64_t count, T* out, bool accumulate) {
  const Grid grid = read_grid(in);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(in + kHeaderBytes);
  for (std::int64_t i = 0; i < count; ++i) {
    const float decoded = dequantize(codes[i], grid);
    out[i] = accumulate ? store<T>(static_cast<compute_type_t<T>>(load(out[i]) + decoded))
                        : store<T>(static_cast<compute_type_t<T>>(decoded));
  }
}

// The fp32 CPU decoder: AVX2 when the CPU has it, else decompress<float>;
// the same values either way (lib/compression/minmax_uint8_cpu.cc).
void decompress_f32(const std::byte* in, std::int64_t count, float* out, bool accumulate);
// The portable loop alone, for tests comparing the two.
void decompress_f32_portable(const std::byte* in, std::int64_t count, float* out, bool accumulate);

}  // namespace bagua::minmax_uint8
