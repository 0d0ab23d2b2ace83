// Compression of tensor views: the dtype dispatch over the element math of
// minmax_uint8.h, and chunked helpers for the ops.
//
// Only floating point tensors are compressed (fp32, fp64, fp16, bf16);
// anything else is an InvalidArgument when the op is created.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

enum class Compression : std::uint8_t { kNone, kMinMaxUInt8 };

constexpr std::string_view to_string(Compression compression) {
  return compression == Compression::kNone ? "none" : "MinMaxUInt8";
}

inline Compression parse_compression(std::string_view name) {
  if (name.empty() || name == "none" || name == "None") return Compression::kNone;
  if (name == "MinMaxUInt8") return Compression::kMinMaxUInt8;
  throw InvalidArgument(
      fmt::format("unknown compression '{}' (supported: MinMaxUInt8, or none)", name));
}

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
    if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      decompress<T>(in, out.numel, out.data_as<T>(), accumulate);
    } else {
      check_compressible(out.dtype, "decompress");
    }
  });
}

// A tensor compressed as consecutive chunks of at most `chunk_elements`, each
// with its own min and max: bounds the quantization error by the local range
// instead of the whole bucket's.
struct ChunkedLayout {
  std::int64_t numel = 0;
  std::int64_t chunk_elements = 1;

  std::int64_t chunks() const {
    return numel == 0 ? 0 : (numel + chunk_elements - 1) / chunk_elements;
  }
  std::size_t bytes() const {
    return static_cast<std::size_t>(numel) + static_cast<std::size_t>(chunks()) * kHeaderBytes;
  }
};

inline void compress_chunked(const TensorView& x, const ChunkedLayout& layout, std::byte* out) {
  for (std::int64_t c = 0; c < layout.chunks(); ++c) {
    const std::int64_t begin = c * layout.chunk_elements;
    const std::int64_t count = std::min(layout.chunk_elements, x.numel - begin);
    compress_view(x.slice(begin, count), out);
    out += compressed_bytes(count);
  }
}

inline void decompress_chunked(const std::byte* in, const ChunkedLayout& layout,
                               const TensorView& out, bool accumulate) {
  for (std::int64_t c = 0; c < layout.chunks(); ++c) {
    const std::int64_t begin = c * layout.chunk_elements;
    const std::int64_t count = std::min(layout.chunk_elements, out.numel - begin);
    decompress_view(in, out.slice(begin, count), accumulate);
    in += compressed_bytes(count);
  }
}

}  // namespace minmax_uint8
}  // namespace bagua
