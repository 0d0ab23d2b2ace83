// Low-precision P-Reduce; see bagua/ops/low_precision_partial_allreduce.h.
#include "bagua/ops/low_precision_partial_allreduce.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/group_tags.h"
#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace {

using group_tags::Chunk;
using group_tags::chunk_of;

// The tags of the two phases: another salt than the full precision ring's.
constexpr std::uint64_t kLowPrecisionSalt = 0x4C505052;  // "LPPR"

std::uint64_t phase_tag(std::span<const int> members, std::uint64_t group_id, int phase) {
  return group_tags::step_tag(group_tags::group_key(members, group_id, kLowPrecisionSalt), phase);
}

void check_call(const Communicator& comm, const TensorView& buffer, std::span<const int> members) {
  BAGUA_CHECK_ARG(buffer.dtype == DType::kFloat32 && buffer.device.type == DeviceType::kCPU,
                  "low-precision partial_allreduce on rank {} takes float32 host memory, got {}",
                  comm.rank(), buffer.describe());
  BAGUA_CHECK_ARG(!members.empty() && std::is_sorted(members.begin(), members.end()) &&
                      std::adjacent_find(members.begin(), members.end()) == members.end() &&
                      members.front() >= 0 && members.back() < comm.size() &&
                      std::find(members.begin(), members.end(), comm.rank()) != members.end(),
                  "low-precision partial_allreduce on rank {}: members {} must be sorted, unique "
                  "ranks of the group of size {} including this one",
                  comm.rank(), fmt::format("{}", fmt::join(members, ",")), comm.size());
}

void check_layout(const Communicator& comm, const TensorView& buffer, const CodeLayout& layout) {
  if (layout.segments.empty()) return;
  std::int64_t total = 0;
  for (const auto length : layout.segments) {
    BAGUA_CHECK_ARG(length >= 0, "low-precision partial_allreduce on rank {}: segment of length {}",
                    comm.rank(), length);
    total += length;
  }
  BAGUA_CHECK_ARG(total == buffer.numel && layout.piece_elements > 0,
                  "low-precision partial_allreduce on rank {}: segments of {} elements in all "
                  "and pieces of {} for a buffer of {}; they must match and pieces be > 0",
                  comm.rank(), total, layout.piece_elements, buffer.numel);
}

// The pieces of `chunk` with a min/max each (CodeLayout): the whole chunk,
// or the chunk cut at every segment's end and every piece_elements from a
// segment's start.
std::vector<Chunk> pieces_of(const Chunk& chunk, const CodeLayout& layout) {
  if (layout.segments.empty()) return {chunk};
  std::vector<Chunk> pieces;
  const std::int64_t end = chunk.offset + chunk.numel;
  std::int64_t segment_start = 0;
  for (const auto length : layout.segments) {
    const std::int64_t segment_end = segment_start + length;
    for (std::int64_t at = std::max(chunk.offset, segment_start);
         at < std::min(end, segment_end);) {
      const std::int64_t next_cut =
          segment_start +
          ((at - segment_start) / layout.piece_elements + 1) * layout.piece_elements;
      const std::int64_t stop = std::min({end, segment_end, next_cut});
      pieces.push_back({at, stop - at});
      at = stop;
    }
    if (segment_end >= end) break;
    segment_start = segment_end;
  }
  return pieces;
}

std::size_t coded_bytes_of(const Chunk& chunk, const CodeLayout& layout) {
  std::size_t bytes = 0;
  for (const Chunk& piece : pieces_of(chunk, layout)) {
    bytes += minmax_uint8::compressed_bytes(piece.numel);
  }
  return bytes;
}

// x[chunk] coded piece by piece, the pieces' codes back to back.
void compress_chunk(const float* x, const Chunk& chunk, const CodeLayout& layout, std::byte* out) {
  for (const Chunk& piece : pieces_of(chunk, layout)) {
    minmax_uint8::compress_f32(x + piece.offset, piece.numel, out);
    out += minmax_uint8::compressed_bytes(piece.numel);
  }
}

void decompress_chunk(const std::byte* in, const Chunk& chunk, const CodeLayout& layout, float* x,
                      bool accumulate) {
  for (const Chunk& piece : pieces_of(chunk, layout)) {
    minmax_uint8::decompress_f32(in, piece.numel, x + piece.offset, accumulate);
    in += minmax_uint8::compressed_bytes(piece.numel);
  }
}

void reduce_in_group(Communicator& comm, const TensorView& buffer, std::span<const int> members,
                     std::uint64_t group_id, const CodeLayout& layout);

}  // namespace

void low_precision_partial_allreduce(Communicator& comm, const TensorView& buffer,
                                     std::span<const int> members, std::uint64_t group_id,
                                     const CodeLayout& layout) {
  check_call(comm, buffer, members);
  check_layout(comm, buffer, layout);
  const auto where = [&] {
    return fmt::format("low-precision partial_allreduce of group {} (ranks {}) on rank {}",
                       group_id, fmt::join(members, ","), comm.rank());
  };
  try {
    reduce_in_group(comm, buffer, members, group_id, layout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: {}", where(), e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: {}", where(), e.what()));
  }
}

std::int64_t low_precision_coded_bytes(std::int64_t numel, int members, const CodeLayout& layout) {
  std::size_t bytes = 0;
  for (int j = 0; j < members; ++j) bytes += coded_bytes_of(chunk_of(numel, members, j), layout);
  return static_cast<std::int64_t>(bytes);
}

namespace {

void reduce_in_group(Communicator& comm, const TensorView& buffer, std::span<const int> members,
                     std::uint64_t group_id, const CodeLayout& layout) {
  const int m = static_cast<int>(members.size());
  if (m == 1 || buffer.numel == 0) return;
  const int me =
      static_cast<int>(std::find(members.begin(), members.end(), comm.rank()) - members.begin());
  auto* x = buffer.data_as<float>();
  const Chunk own = chunk_of(buffer.numel, m, me);
  const auto bytes_of = [&](const Chunk& c) { return coded_bytes_of(c, layout); };
  const auto bytes_view = [](std::vector<std::byte>& v) {
    return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kUInt8, {}};
  };

  // Phase 1: chunk j of every member to member j.
  std::vector<std::vector<std::byte>> outgoing(static_cast<std::size_t>(m));
  std::vector<std::vector<std::byte>> incoming(static_cast<std::size_t>(m));
  std::vector<PeerMessage> sends, receives;
  const std::uint64_t scatter_tag = phase_tag(members, group_id, 1);
  for (int j = 0; j < m; ++j) {
    if (j == me) continue;
    const Chunk c = chunk_of(buffer.numel, m, j);
    auto& out = outgoing[static_cast<std::size_t>(j)];
    out.resize(bytes_of(c));
    compress_chunk(x, c, layout, out.data());
    sends.push_back({bytes_view(out), members[static_cast<std::size_t>(j)], scatter_tag});
    auto& in = incoming[static_cast<std::size_t>(j)];
    in.resize(bytes_of(own));
    receives.push_back({bytes_view(in), members[static_cast<std::size_t>(j)], scatter_tag});
  }
  comm.send_recv(sends, receives);

  // The owner's average of its chunk (its own values exact, the others
  // decoded), compressed once: every member decodes these same bytes.
  for (int j = 0; j < m; ++j) {
    if (j != me) {
      decompress_chunk(incoming[static_cast<std::size_t>(j)].data(), own, layout, x,
                       /*accumulate=*/true);
    }
  }
  float* mine = x + own.offset;
  for (std::int64_t i = 0; i < own.numel; ++i) mine[i] /= static_cast<float>(m);
  std::vector<std::byte> average(bytes_of(own));
  compress_chunk(x, own, layout, average.data());
  decompress_chunk(average.data(), own, layout, x, /*accumulate=*/false);

  // Phase 2: every owner's compressed average to every member.
  sends.clear();
  receives.clear();
  const std::uint64_t gather_tag = phase_tag(members, group_id, 2);
  for (int j = 0; j < m; ++j) {
    if (j == me) continue;
    sends.push_back({bytes_view(average), members[static_cast<std::size_t>(j)], gather_tag});
    auto& in = incoming[static_cast<std::size_t>(j)];
    in.resize(bytes_of(chunk_of(buffer.numel, m, j)));
    receives.push_back({bytes_view(in), members[static_cast<std::size_t>(j)], gather_tag});
  }
  comm.send_recv(sends, receives);
  for (int j = 0; j < m; ++j) {
    if (j == me) continue;
    decompress_chunk(incoming[static_cast<std::size_t>(j)].data(), chunk_of(buffer.numel, m, j),
                     layout, x, /*accumulate=*/false);
  }
}

}  // namespace
}  // namespace bagua
