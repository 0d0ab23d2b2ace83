// Per-element math shared by the CPU loops (elementwise.h) and the CUDA
// kernels (kernels/): loading 16-bit floats into float, combining two values
// under a ReduceOp, dividing for averages. Free of host-only dependencies so
// nvcc compiles it for the device.
#pragma once

#include <cstdint>
#include <type_traits>

#include "bagua/comm/reduce_op.h"
#include "bagua/core/half.h"
#include "bagua/core/host_device.h"

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

// The asynchronous model average update of one element:
// w + sum / n - snapshot, where `snapshot` is w when the round started and
// `sum` the sum of all ranks' snapshots (training's progress since the
// snapshot is kept).
template <typename T>
BAGUA_HOST_DEVICE inline T async_average_update(T w, T sum, T snapshot, std::int64_t n) {
  using C = compute_type_t<T>;
  return store<T>(static_cast<C>(load(w) + load(sum) / static_cast<C>(n) - load(snapshot)));
}

// The low-precision decentralized difference of one element, in float:
// d = x + L/3 + R/3 - 5W/3 (see ops/decentralized_low_precision.h), with x
// this rank's new weight, W its last shared weight and L, R its copies of
// the neighbours'. One formula for the CPU loop and the kernel, so both
// compress the same values.
template <typename T>
BAGUA_HOST_DEVICE inline float low_precision_ring_diff(T x, T w, T l, T r) {
  const float lf = static_cast<float>(load(l));
  const float rf = static_cast<float>(load(r));
  const float wf = static_cast<float>(load(w));
  return static_cast<float>(load(x)) + lf / 3.0f + rf / 3.0f - 5.0f * wf / 3.0f;
}

}  // namespace bagua
