#include <doctest/doctest.h>

#include <cmath>
#include <limits>

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
