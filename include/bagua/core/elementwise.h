// Element-wise math on tensor views: dtype dispatch, pairwise reduction and
// scaling. Written once and used by every CPU code path (the Gloo reduction
// callbacks, local reductions of scatter-gather ops, averaging).
//
// 16-bit floats are computed in float and rounded once per element.
// Integer averages truncate toward zero (integer division).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "bagua/core/element_math.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

// Calls fn(T{}) with T the C++ type of `dtype`.
template <typename Fn>
decltype(auto) dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat64: return fn(double{});
    case DType::kFloat16: return fn(Half{});
    case DType::kBFloat16: return fn(BFloat16{});
    case DType::kInt32: return fn(std::int32_t{});
    case DType::kInt64: return fn(std::int64_t{});
    case DType::kUInt8: return fn(std::uint8_t{});
  }
  throw InternalError("dispatch_dtype: unknown dtype");
}

// out[i] = a[i] (op) b[i] for i < count. `out` may alias `a` or `b`.
// kAvg combines like kSum; the caller divides once all operands are in.
template <typename T>
void reduce_elements(ReduceOp op, T* out, const T* a, const T* b, std::size_t count) {
  if constexpr (is_half_type_v<T>) {
    for (std::size_t i = 0; i < count; ++i)
      out[i] = store<T>(combine<T>(op, load(a[i]), load(b[i])));
  } else {
    // Separate loops per operator keep each one trivially vectorizable.
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(a[i] + b[i]);
        break;
      case ReduceOp::kProduct:
        for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(a[i] * b[i]);
        break;
      case ReduceOp::kMin:
        for (std::size_t i = 0; i < count; ++i) out[i] = std::min(a[i], b[i]);
        break;
      case ReduceOp::kMax:
        for (std::size_t i = 0; i < count; ++i) out[i] = std::max(a[i], b[i]);
        break;
    }
  }
}

// Whether x * (1 / divisor) has the bits of x / divisor for every float x:
// when 1 / divisor is exact (a power of two) both round the same real
// number, and the product is several times cheaper than the quotient.
inline bool reciprocal_is_exact(std::int64_t divisor) {
  return divisor > 0 && (divisor & (divisor - 1)) == 0;
}

// x[i] = x[i] / divisor: the averaging step after a sum.
template <typename T>
void divide_elements(T* x, std::size_t count, std::int64_t divisor) {
  if constexpr (is_half_type_v<T>) {
    for (std::size_t i = 0; i < count; ++i) x[i] = divide_one(x[i], divisor);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (reciprocal_is_exact(divisor)) {
      const T inverse = T{1} / static_cast<T>(divisor);
      for (std::size_t i = 0; i < count; ++i) x[i] *= inverse;
      return;
    }
    const auto d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < count; ++i) x[i] = x[i] / d;
  } else {
    const auto d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(x[i] / d);
  }
}

// out[i] = (a[i] + b[i]) / divisor: an average's last sum and its division
// in one pass, with the bits of reduce_elements(kSum) then divide_elements.
// `out` may alias `a` or `b`.
template <typename T>
void sum_then_divide(T* out, const T* a, const T* b, std::size_t count, std::int64_t divisor) {
  if constexpr (std::is_floating_point_v<T>) {
    if (reciprocal_is_exact(divisor)) {
      const T inverse = T{1} / static_cast<T>(divisor);
      for (std::size_t i = 0; i < count; ++i) out[i] = (a[i] + b[i]) * inverse;
      return;
    }
    const auto d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < count; ++i) out[i] = (a[i] + b[i]) / d;
  } else {
    reduce_elements<T>(ReduceOp::kSum, out, a, b, count);
    divide_elements<T>(out, count, divisor);
  }
}

inline void reduce_into(ReduceOp op, const TensorView& out, const TensorView& a,
                        const TensorView& b) {
  BAGUA_CHECK_ARG(
      out.numel == a.numel && out.numel == b.numel && out.dtype == a.dtype && out.dtype == b.dtype,
      "reduce_into: operands differ ({}, {}, {})", out.describe(), a.describe(), b.describe());
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    reduce_elements<T>(op, out.data_as<T>(), a.data_as<T>(), b.data_as<T>(),
                       static_cast<std::size_t>(out.numel));
  });
}

inline void divide_inplace(const TensorView& x, std::int64_t divisor) {
  if (divisor == 1) return;
  // Device memory is divided by the runtime's Compute, on the device's stream.
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCPU, "divide_inplace runs on host memory, got {}",
                  x.describe());
  dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    divide_elements<T>(x.data_as<T>(), static_cast<std::size_t>(x.numel), divisor);
  });
}

}  // namespace bagua
