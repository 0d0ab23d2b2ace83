// A non-owning view of a contiguous tensor: pointer, element count, dtype,
// device. Python builds one from `tensor.data_ptr()`; the runtime never
// depends on libtorch, so one build serves every PyTorch version.
//
// Ownership: the caller keeps the memory alive for as long as the view is
// registered (buckets hold views of gradients owned by PyTorch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "bagua/core/dtype.h"
#include "bagua/core/errors.h"

namespace bagua {

enum class DeviceType : std::uint8_t { kCPU, kCUDA };

constexpr std::string_view to_string(DeviceType type) {
  return type == DeviceType::kCPU ? "cpu" : "cuda";
}

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = -1;

  bool operator==(const Device&) const = default;
  std::string str() const {
    return type == DeviceType::kCPU ? "cpu" : fmt::format("cuda:{}", index);
  }
};

// The dtype named `name`; InvalidArgument naming the supported ones if none.
inline DType parse_dtype(std::string_view name) {
  const auto dtype = dtype_from_string(name);
  if (!dtype) {
    throw InvalidArgument(fmt::format(
        "unsupported dtype '{}' (supported: float32, float64, float16, bfloat16, int32, int64, "
        "uint8)",
        name));
  }
  return *dtype;
}

struct TensorView {
  void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
  Device device{};

  std::size_t nbytes() const { return static_cast<std::size_t>(numel) * dtype_size(dtype); }
  std::byte* bytes() const { return static_cast<std::byte*>(data); }

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }

  // Elements [offset, offset + count) of this view.
  TensorView slice(std::int64_t offset, std::int64_t count) const {
    BAGUA_CHECK_ARG(offset >= 0 && count >= 0 && offset + count <= numel,
                    "slice [{}, {}) out of range for a tensor of {} elements", offset,
                    offset + count, numel);
    return TensorView{bytes() + static_cast<std::size_t>(offset) * dtype_size(dtype), count, dtype,
                      device};
  }

  std::string describe() const {
    return fmt::format("{}[{}] on {}", to_string(dtype), numel, device.str());
  }
};

}  // namespace bagua
