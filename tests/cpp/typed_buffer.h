// A tensor of any supported dtype owned by a test, read and written as
// doubles, so one test body covers every dtype.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "bagua/core/elementwise.h"

namespace bagua::testing {

class TypedBuffer {
 public:
  TypedBuffer(DType dtype, std::int64_t numel)
      : dtype_(dtype), storage_(static_cast<std::size_t>(numel) * dtype_size(dtype) + 1) {
    numel_ = numel;
  }

  TensorView view() { return TensorView{storage_.data(), numel_, dtype_, {}}; }
  std::int64_t numel() const { return numel_; }

  void set(std::int64_t i, double value) {
    dispatch_dtype(dtype_, [&](auto tag) {
      using T = decltype(tag);
      reinterpret_cast<T*>(storage_.data())[i] = store<T>(static_cast<compute_type_t<T>>(value));
    });
  }

  double get(std::int64_t i) const {
    return dispatch_dtype(dtype_, [&](auto tag) {
      using T = decltype(tag);
      return static_cast<double>(load(reinterpret_cast<const T*>(storage_.data())[i]));
    });
  }

 private:
  DType dtype_;
  std::int64_t numel_ = 0;
  std::vector<std::byte> storage_;
};

// How close a value of `dtype` must be to an exact reference.
inline double tolerance(DType dtype, double reference) {
  switch (dtype) {
    case DType::kFloat16: return 1e-3 * std::abs(reference) + 1e-3;
    case DType::kBFloat16: return 8e-3 * std::abs(reference) + 8e-3;
    case DType::kFloat32: return 1e-6 * std::abs(reference) + 1e-6;
    case DType::kFloat64: return 1e-12 * std::abs(reference) + 1e-12;
    default: return 0.0;
  }
}

inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> dtypes{DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                         DType::kBFloat16, DType::kInt32,   DType::kInt64,
                                         DType::kUInt8};
  return dtypes;
}

}  // namespace bagua::testing
