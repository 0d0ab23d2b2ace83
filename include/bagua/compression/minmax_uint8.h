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

BAGUA_HOST_DEVICE inline std::uint8_t quantize(float x, const Grid& grid) {
  if (grid.constant || grid.non_finite) return 0;
  // Clamping the code (not only the level) keeps it in [0, 255] also when
  // |x| * scale passes 2^24 and upper - lower is no longer exactly 255 in
  // float; the error then grows by float rounding of x * scale only.
  const float code = rintf(x * grid.scale) - grid.lower;
  return static_cast<std::uint8_t>(code < 0.0f ? 0.0f : (code > 255.0f ? 255.0f : code));
}

BAGUA_HOST_DEVICE inline float dequantize(std::uint8_t q, const Grid& grid) {
  if (grid.non_finite) return std::numeric_limits<float>::quiet_NaN();
  if (grid.constant) return grid.min;
  return (static_cast<float>(q) + grid.lower) / grid.scale;
}

// ---- CPU path ---------------------------------------------------------------

// Writes the compressed form of x[0, count) to `out` (compressed_bytes(count)).
template <typename T>
void compress(const T* x, std::int64_t count, std::byte* out) {
  float min = 0.0f;
  float max = 0.0f;
  bool finite = true;
  if (count > 0) {
    min = max = static_cast<float>(load(x[0]));
    for (std::int64_t i = 0; i < count; ++i) {
      const float v = static_cast<float>(load(x[i]));
      finite = finite && std::isfinite(v);
      min = v < min ? v : min;
      max = v > max ? v : max;
    }
  }
  if (!finite) min = max = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(out, &min, sizeof(float));
  std::memcpy(out + sizeof(float), &max, sizeof(float));
  const Grid grid = make_grid(min, max);
  auto* codes = reinterpret_cast<std::uint8_t*>(out + kHeaderBytes);
  for (std::int64_t i = 0; i < count; ++i) {
    codes[i] = quantize(static_cast<float>(load(x[i])), grid);
  }
}

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

}  // namespace bagua::minmax_uint8
