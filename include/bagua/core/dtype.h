// Element types the runtime can communicate, with their sizes and names.
//
// The names match PyTorch's (`torch.float32` -> "float32"), so the Python
// layer passes `str(tensor.dtype)` minus the "torch." prefix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace bagua {

enum class DType : std::uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kUInt8,
};

constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

constexpr bool is_floating_point(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

constexpr std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

// The dtype named `name`, or nothing when the runtime does not support it.
constexpr std::optional<DType> dtype_from_string(std::string_view name) {
  for (auto dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                     DType::kInt32, DType::kInt64, DType::kUInt8}) {
    if (to_string(dtype) == name) return dtype;
  }
  return std::nullopt;
}

}  // namespace bagua
