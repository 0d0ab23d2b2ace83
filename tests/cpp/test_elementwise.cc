#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bagua/core/elementwise.h"
#include "bagua/core/half.h"
#include "typed_buffer.h"

using namespace bagua;

TEST_CASE("half conversions round to nearest even and keep specials") {
  CHECK(Half::to_float(Half::from_float(1.0f)) == 1.0f);
  CHECK(Half::to_float(Half::from_float(-2.5f)) == -2.5f);
  CHECK(Half::to_float(Half::from_float(65504.0f)) == 65504.0f);
  CHECK(std::isinf(Half::to_float(Half::from_float(70000.0f))));
  CHECK(std::isnan(Half::to_float(Half::from_float(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(Half::to_float(Half::from_float(std::numeric_limits<float>::infinity()))));
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to the even one (1).
  CHECK(Half::to_float(Half::from_float(1.0f + 0.00048828125f)) == 1.0f);
  CHECK(Half::to_float(Half::from_float(1.0f + 3 * 0.00048828125f)) == 1.001953125f);
  // Smallest subnormal, 2^-24.
  CHECK(Half::to_float(Half::from_float(5.9604644775390625e-8f)) == 5.9604644775390625e-8f);
  CHECK(Half::to_float(Half::from_float(0.0f)) == 0.0f);
}

TEST_CASE("every half value survives a round trip through float") {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = Half::to_float(h);
    if (std::isnan(f)) continue;
    REQUIRE(Half::from_float(f) == h);
  }
}

TEST_CASE("bfloat16 conversions") {
  CHECK(BFloat16::to_float(BFloat16::from_float(1.0f)) == 1.0f);
  CHECK(BFloat16::to_float(BFloat16::from_float(3.0f)) == 3.0f);
  CHECK(std::isnan(
      BFloat16::to_float(BFloat16::from_float(std::numeric_limits<float>::quiet_NaN()))));
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto b = static_cast<std::uint16_t>(bits);
    const float f = BFloat16::to_float(b);
    if (std::isnan(f)) continue;
    REQUIRE(BFloat16::from_float(f) == b);
  }
}

TEST_CASE("reduce_into and divide_inplace on every dtype") {
  for (DType dtype : testing::all_dtypes()) {
    CAPTURE(to_string(dtype));
    testing::TypedBuffer a(dtype, 9), b(dtype, 9), out(dtype, 9);
    for (int i = 0; i < 9; ++i) {
      a.set(i, i + 1);
      b.set(i, 10 - i);
    }
    reduce_into(ReduceOp::kSum, out.view(), a.view(), b.view());
    for (int i = 0; i < 9; ++i) CHECK(out.get(i) == 11);
    reduce_into(ReduceOp::kMax, out.view(), a.view(), b.view());
    for (int i = 0; i < 9; ++i) CHECK(out.get(i) == std::max(i + 1, 10 - i));
    reduce_into(ReduceOp::kMin, out.view(), a.view(), b.view());
    for (int i = 0; i < 9; ++i) CHECK(out.get(i) == std::min(i + 1, 10 - i));
    reduce_into(ReduceOp::kProduct, out.view(), a.view(), b.view());
    for (int i = 0; i < 9; ++i) CHECK(out.get(i) == (i + 1) * (10 - i));
    divide_inplace(a.view(), 2);
    for (int i = 0; i < 9; ++i) {
      const double expected =
          is_floating_point(dtype) ? (i + 1) / 2.0 : static_cast<double>((i + 1) / 2);
      CHECK(a.get(i) == doctest::Approx(expected));
    }
  }
}

TEST_CASE("reduce_into rejects mismatched operands") {
  testing::TypedBuffer a(DType::kFloat32, 3), b(DType::kFloat32, 4);
  CHECK_THROWS_AS(reduce_into(ReduceOp::kSum, a.view(), a.view(), b.view()), InvalidArgument);
}

namespace {

// Float bit patterns drawn over every exponent (subnormals, extremes,
// infinities and NaNs included), so that no rounding case is left out.
template <typename F, typename Bits>
std::vector<F> floats_over_every_exponent(std::size_t count, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<F> values(count);
  for (auto& v : values) {
    const auto bits = static_cast<Bits>(rng());
    std::memcpy(&v, &bits, sizeof(F));
  }
  return values;
}

bool same_bits_or_both_nan(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) ||
         std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}

template <typename F, typename Bits>
void check_reciprocal_and_fused_average(unsigned seed) {
  const auto a = floats_over_every_exponent<F, Bits>(20'000, seed);
  const auto b = floats_over_every_exponent<F, Bits>(20'000, seed + 1);
  for (std::int64_t divisor = 1; divisor <= 9; ++divisor) {
    CAPTURE(divisor);
    std::vector<F> divided(a), fused(a.size());
    divide_elements<F>(divided.data(), divided.size(), divisor);
    sum_then_divide<F>(fused.data(), a.data(), b.data(), a.size(), divisor);
    for (std::size_t i = 0; i < a.size(); ++i) {
      CAPTURE(a[i]);
      CAPTURE(b[i]);
      // The references: IEEE division, one element at a time.
      const F quotient = a[i] / static_cast<F>(divisor);
      const F sum = a[i] + b[i];
      const F average = sum / static_cast<F>(divisor);
      REQUIRE(same_bits_or_both_nan(divided[i], quotient));
      REQUIRE(same_bits_or_both_nan(fused[i], average));
    }
  }
}

}  // namespace

TEST_CASE("dividing by a power of two through its reciprocal keeps the quotient's bits") {
  CHECK(reciprocal_is_exact(1));
  CHECK(reciprocal_is_exact(8));
  CHECK_FALSE(reciprocal_is_exact(6));
  CHECK_FALSE(reciprocal_is_exact(0));
  check_reciprocal_and_fused_average<float, std::uint32_t>(7);
  check_reciprocal_and_fused_average<double, std::uint64_t>(11);
}

TEST_CASE("sum_then_divide equals reduce_elements then divide_elements on every dtype") {
  // 16-bit floats and integers: the fused call must round as the two passes do.
  auto check = [](auto tag) {
    using T = decltype(tag);
    std::vector<T> a(257), b(257);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto x = static_cast<float>(i) * 0.37f - 40.0f,
                 y = 17.0f - static_cast<float>(i) * 0.11f;
      if constexpr (is_half_type_v<T>) {
        a[i] = store<T>(x);
        b[i] = store<T>(y);
      } else {
        a[i] = static_cast<T>(x);
        b[i] = static_cast<T>(y);
      }
    }
    for (std::int64_t divisor : {1, 2, 3, 4, 5}) {
      std::vector<T> two_passes(a.size()), fused(a.size());
      reduce_elements<T>(ReduceOp::kSum, two_passes.data(), a.data(), b.data(), a.size());
      divide_elements<T>(two_passes.data(), two_passes.size(), divisor);
      sum_then_divide<T>(fused.data(), a.data(), b.data(), a.size(), divisor);
      const bool same_bytes =
          std::memcmp(two_passes.data(), fused.data(), a.size() * sizeof(T)) == 0;
      REQUIRE(same_bytes);
    }
  };
  check(Half{});
  check(BFloat16{});
  check(std::int32_t{});
  check(std::int64_t{});
}
