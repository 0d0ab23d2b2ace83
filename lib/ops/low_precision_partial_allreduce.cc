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

void reduce_in_group(Communicator& comm, const TensorView& buffer, std::span<const int> members,
                     std::uint64_t group_id);

}  // namespace

void low_precision_partial_allreduce(Communicator& comm, const TensorView& buffer,
                                     std::span<const int> members, std::uint64_t group_id) {
  check_call(comm, buffer, members);
  const auto where = [&] {
    return fmt::format("low-precision partial_allreduce of group {} (ranks {}) on rank {}",
                       group_id, fmt::join(members, ","), comm.rank());
  };
  try {
    reduce_in_group(comm, buffer, members, group_id);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: {}", where(), e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: {}", where(), e.what()));
  }
}

namespace {

void reduce_in_group(Communicator& comm, const TensorView& buffer, std::span<const int> members,
                     std::uint64_t group_id) {
  const int m = static_cast<int>(members.size());
  if (m == 1 || buffer.numel == 0) return;
  const int me =
      static_cast<int>(std::find(members.begin(), members.end(), comm.rank()) - members.begin());
  auto* x = buffer.data_as<float>();
  const Chunk own = chunk_of(buffer.numel, m, me);
  const auto bytes_of = [](const Chunk& c) { return minmax_uint8::compressed_bytes(c.numel); };
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
    minmax_uint8::compress_f32(x + c.offset, c.numel, out.data());
    sends.push_back({bytes_view(out), members[static_cast<std::size_t>(j)], scatter_tag});
    auto& in = incoming[static_cast<std::size_t>(j)];
    in.resize(bytes_of(own));
    receives.push_back({bytes_view(in), members[static_cast<std::size_t>(j)], scatter_tag});
  }
  comm.send_recv(sends, receives);

  // The owner's average of its chunk (its own values exact, the others
  // decoded), compressed once: every member decodes these same bytes.
  float* mine = x + own.offset;
  for (int j = 0; j < m; ++j) {
    if (j != me)
      minmax_uint8::decompress_f32(incoming[static_cast<std::size_t>(j)].data(), own.numel, mine,
                                   /*accumulate=*/true);
  }
  for (std::int64_t i = 0; i < own.numel; ++i) mine[i] /= static_cast<float>(m);
  std::vector<std::byte> average(bytes_of(own));
  minmax_uint8::compress_f32(mine, own.numel, average.data());
  minmax_uint8::decompress_f32(average.data(), own.numel, mine, /*accumulate=*/false);

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
    const Chunk c = chunk_of(buffer.numel, m, j);
    minmax_uint8::decompress_f32(incoming[static_cast<std::size_t>(j)].data(), c.numel,
                                 x + c.offset, /*accumulate=*/false);
  }
}

}  // namespace
}  // namespace bagua
