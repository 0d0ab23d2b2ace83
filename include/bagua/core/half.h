// 16-bit floating point storage types (IEEE half and bfloat16) with
// round-to-nearest-even conversions from and to float.
//
// Arithmetic on them goes through float: the runtime accumulates fp16/bf16
// reductions in fp32 per pair of operands, as Gloo and NCCL do.
#pragma once

#include <cstdint>
#include <cstring>

#include "bagua/core/host_device.h"

namespace bagua {

namespace detail {

BAGUA_HOST_DEVICE inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

BAGUA_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace detail

// What Half and BFloat16 share: 16 bits of storage, converted from and to
// float by the format's own from_float / to_float (a static base, so that
// device code calls them directly).
template <typename Format>
struct Float16Storage {
  std::uint16_t bits = 0;

  Float16Storage() = default;
  BAGUA_HOST_DEVICE explicit Float16Storage(float value) : bits(Format::from_float(value)) {}
  BAGUA_HOST_DEVICE explicit operator float() const { return Format::to_float(bits); }
};

struct Half : Float16Storage<Half> {
  using Float16Storage::Float16Storage;

  BAGUA_HOST_DEVICE static std::uint16_t from_float(float value) {
    const std::uint32_t f = detail::float_bits(value);
    const std::uint32_t sign = (f >> 16) & 0x8000u;
    const std::uint32_t abs = f & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // Inf or NaN (NaN keeps a quiet payload bit)
      return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477ff000u) {  // rounds to a value beyond the largest half
      return static_cast<std::uint16_t>(sign | 0x7c00u);
    }
    if (abs < 0x38800000u) {  // subnormal half (or zero)
      // Add 0.5 as a float so the FPU performs the round-to-nearest-even shift.
      const float shifted = detail::bits_float(abs) + 0.5f;
      return static_cast<std::uint16_t>(sign | (detail::float_bits(shifted) - 0x3f000000u));
    }
    const std::uint32_t mantissa_odd = (abs >> 13) & 1u;
    const std::uint32_t rounded = abs + 0xc8000fffu + mantissa_odd;  // rebias exponent, round
    return static_cast<std::uint16_t>(sign | (rounded >> 13));
  }

  BAGUA_HOST_DEVICE static float to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1fu;
    std::uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) {
      return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
    }
    if (exponent == 0) {
      if (mantissa == 0) return detail::bits_float(sign);
      // Subnormal: value = mantissa * 2^-24, exact in float.
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      return sign != 0 ? -magnitude : magnitude;
    }
    return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

struct BFloat16 : Float16Storage<BFloat16> {
  using Float16Storage::Float16Storage;

  BAGUA_HOST_DEVICE static std::uint16_t from_float(float value) {
    const std::uint32_t f = detail::float_bits(value);
    if ((f & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
      return static_cast<std::uint16_t>((f >> 16) | 0x40u);
    }
    const std::uint32_t rounding_bias = 0x7fffu + ((f >> 16) & 1u);
    return static_cast<std::uint16_t>((f + rounding_bias) >> 16);
  }

  BAGUA_HOST_DEVICE static float to_float(std::uint16_t b) {
    return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
  }
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

}  // namespace bagua
