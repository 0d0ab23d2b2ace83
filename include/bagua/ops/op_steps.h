// The comm ops' own element-wise steps on a Compute: the formulas of
// op_math.h as host loops for CPU buckets and as the kernels of
// kernels/op_kernels.cu for CUDA buckets (Compute::run_custom picks), so an
// op calls one function for both.
//
// The cuda_* functions are those kernels on a stream of the caller's (a
// cudaStream_t; nullptr is the legacy default stream), which Python's GPU
// tests also call directly: InvalidArgument for host tensors or mismatched
// operands (and, without CUDA in the build, for anything:
// lib/ops/op_kernels_absent.cc), BackendError when the launch fails.
#pragma once

#include <cstdint>

#include "bagua/core/elementwise.h"
#include "bagua/core/tensor_view.h"
#include "bagua/ops/op_math.h"
#include "bagua/runtime/compute.h"

namespace bagua {

// w = async_average_update(w, sum, snapshot, ranks) element-wise, on the
// device (all four of one dtype and size).
void cuda_async_average_update(const TensorView& w, const TensorView& sum,
                               const TensorView& snapshot, std::int64_t ranks, void* stream);

// d_out[0] += ||snapshot - sum / ranks||^2, d_out[1] += ||sum / ranks||^2 on
// the device (sum, snapshot of one dtype and size; d_out: two doubles on the
// same device, zeroed by the caller).
void cuda_async_average_drift(const TensorView& sum, const TensorView& snapshot, std::int64_t ranks,
                              double* d_out, void* stream);

// diff (fp32) = low_precision_ring_diff(x, w, l, r) element-wise (x, w, l, r
// of one dtype and size), on the device.
void cuda_low_precision_ring_diff(const TensorView& x, const TensorView& w, const TensorView& l,
                                  const TensorView& r, const TensorView& diff, void* stream);

// w = async_average_update(w, sum, snapshot, ranks) on c's device.
inline void apply_async_average_update(Compute& c, const TensorView& w, const TensorView& sum,
                                       const TensorView& snapshot, std::int64_t ranks) {
  const auto on_host = [&] {
    dispatch_dtype(w.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* out = w.data_as<T>();
      const T* sums = sum.data_as<T>();
      const T* snapshots = snapshot.data_as<T>();
      for (std::int64_t i = 0; i < w.numel; ++i) {
        out[i] = async_average_update(out[i], sums[i], snapshots[i], ranks);
      }
    });
  };
  c.run_custom(on_host,
               [&](void* stream) { cuda_async_average_update(w, sum, snapshot, ranks, stream); });
}

// diff (fp32) = low_precision_ring_diff(x, w, l, r) on c's device.
inline void apply_low_precision_ring_diff(Compute& c, const TensorView& x, const TensorView& w,
                                          const TensorView& l, const TensorView& r,
                                          const TensorView& diff) {
  const auto on_host = [&] {
    dispatch_dtype(x.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* xs = x.data_as<T>();
      const T* ws = w.data_as<T>();
      const T* ls = l.data_as<T>();
      const T* rs = r.data_as<T>();
      float* out = diff.data_as<float>();
      for (std::int64_t i = 0; i < x.numel; ++i) {
        out[i] = low_precision_ring_diff(xs[i], ws[i], ls[i], rs[i]);
      }
    });
  };
  c.run_custom(on_host,
               [&](void* stream) { cuda_low_precision_ring_diff(x, w, l, r, diff, stream); });
}

}  // namespace bagua
