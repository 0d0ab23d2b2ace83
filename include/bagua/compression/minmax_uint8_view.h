// MinMaxUInt8 on tensor views: the dtype dispatch over the element math of
// minmax_uint8.h for one chunk held in a TensorView, and the check that a
// dtype can be compressed at all.
//
// Only floating point tensors are compressed (fp32, fp64, fp16, bf16);
// anything else is an InvalidArgument, raised when an op is created.
#pragma once

#include <cstddef>
#include <string_view>
#include <type_traits>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

inline void check_compressible(DType dtype, std::string_view op) {
  BAGUA_CHECK_ARG(is_floating_point(dtype),
                  "{}: MinMaxUInt8 compresses floating point tensors, got {}", op,
                  to_string(dtype));
}

namespace minmax_uint8 {

// Compresses `chunk` (any floating dtype) into `out` (compressed_bytes(numel)).
inline void compress_view(const TensorView& chunk, std::byte* out) {
  dispatch_dtype(chunk.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      compress_f32(chunk.data_as<float>(), chunk.numel, out);
    } else if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      compress<T>(chunk.data_as<T>(), chunk.numel, out);
    } else {
      check_compressible(chunk.dtype, "compress");
    }
  });
}

// Decodes `in` into `out` (numel elements), adding when `accumulate`.
inline void decompress_view(const std::byte* in, const TensorView& out, bool accumulate) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      decompress_f32(in, out.numel, out.data_as<float>(), accumulate);
    } else if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      decompress<T>(in, out.numel, out.data_as<T>(), accumulate);
    } else {
      check_compressible(out.dtype, "decompress");
    }
  });
}

}  // namespace minmax_uint8
}  // namespace bagua
