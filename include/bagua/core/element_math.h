// Per-element math shared by the CPU loops (elementwise.h) and the CUDA
// kernels (kernels/): loading 16-bit floats into float, combining two values
// under a ReduceOp, dividing for averages. Free of host-only dependencies so
// nvcc compiles it for the device. Formulas that belong to one comm op live
// with the ops (bagua/ops/op_math.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "bagua/core/half.h"
#include "bagua/core/host_device.h"
#include "bagua/core/reduce_op.h"

namespace bagua {

template <typename T>
constexpr bool is_half_type_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// The type arithmetic is carried out in for storage type T.
template <typename T>
using compute_type_t = std::conditional_t<is_half_type_v<T>, float, T>;

template <typename T>
BAGUA_HOST_DEVICE inline compute_type_t<T> load(T value) {
  return static_cast<compute_type_t<T>>(value);
}

template <typename T>
BAGUA_HOST_DEVICE inline T store(compute_type_t<T> value) {
  return T(value);
}

template <typename T>
BAGUA_HOST_DEVICE inline compute_type_t<T> combine(ReduceOp op, compute_type_t<T> a,
                                                   compute_type_t<T> b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return b < a ? b : a;
    case ReduceOp::kMax: return b > a ? b : a;
  }
  return a;
}

template <typename T>
BAGUA_HOST_DEVICE inline T divide_one(T value, std::int64_t divisor) {
  if constexpr (is_half_type_v<T>) {
    return store<T>(load(value) / static_cast<float>(divisor));
  } else {
    return static_cast<T>(value / static_cast<T>(divisor));
  }
}

}  // namespace bagua
