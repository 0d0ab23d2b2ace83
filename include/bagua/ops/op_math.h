// The per-element formulas that belong to one comm op each, written once as
// BAGUA_HOST_DEVICE functions: the host loops (op_steps.h) and the CUDA
// kernels (kernels/op_kernels.cu) apply the same formula, so the CPU and GPU
// paths compute the same values. Free of host-only dependencies so nvcc
// compiles it for the device; the math shared by every op (load, store,
// combine, divide) is in bagua/core/element_math.h.
#pragma once

#include <cstdint>

#include "bagua/core/element_math.h"
#include "bagua/core/host_device.h"

namespace bagua {

// The asynchronous model average update of one element
// (ops/asynchronous_model_average.h): w + sum / n - snapshot, where
// `snapshot` is w when the round started and `sum` the sum of all ranks'
// snapshots (training's progress since the snapshot is kept).
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
