// The chunked MinMaxUInt8 layout: a tensor compressed as consecutive chunks
// of at most `chunk_elements`, each with its own min and max, which bounds
// the quantization error by the local range instead of the whole bucket's.
// The chunks' compressed forms lie back to back (docs/compression.md); the
// CUDA kernels write the same layout.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/core/tensor_view.h"

namespace bagua::minmax_uint8 {

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

}  // namespace bagua::minmax_uint8
