// What the neighbour ops (neighbor_allreduce.h, neighbor_allgather.h) share:
// the message tag of a call, the collective check of a call's pattern and
// the exchange of its data.
//
// Pattern check: before moving data, every rank allgathers who it sends to
// and receives from (plus the call's tag and dtype, and its element count when
// the op needs equal sizes), so every rank sees the same table and reaches the
// same verdict: a mismatch is an InvalidArgument (a ValueError in Python) on
// every rank, nothing was sent, and the communicator stays usable. Without the
// check a mismatch ends in the communicator's timeout on the ranks involved.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

// The tag of the `sequence`-th call named `name` (FNV-1a of the name, mixed
// with the sequence): calls matched out of order carry different tags.
inline std::uint64_t neighbor_tag(std::string_view name, std::int64_t sequence) {
  std::uint64_t hash = 1469598103934665603ull;
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return hash ^ (static_cast<std::uint64_t>(sequence) * 0x9E3779B97F4A7C15ull);
}

// Counts calls per name, so every rank derives the same tag for its k-th call
// of a name. Not thread-safe: one per communicator, used by one thread.
class NeighborSequence {
 public:
  std::uint64_t next_tag(const std::string& name) { return neighbor_tag(name, sequence_[name]++); }

 private:
  std::unordered_map<std::string, std::int64_t> sequence_;
};

struct NeighborPattern {
  std::string_view op;  // for messages
  std::uint64_t tag = 0;
  DType dtype = DType::kFloat32;
  std::int64_t numel = -1;  // -1: sizes may differ per rank (allgather)
  std::vector<int> sends;
  std::vector<int> receives;
};

namespace detail {

inline constexpr std::int64_t kSends = 1;
inline constexpr std::int64_t kReceives = 2;
inline constexpr int kPatternHeader = 3;  // tag, dtype, numel

// Rank r's row of the table: tag, dtype, numel, then one flag word per rank.
inline std::vector<std::int64_t> pattern_row(const NeighborPattern& p, int n) {
  std::vector<std::int64_t> row(kPatternHeader + n, 0);
  row[0] = static_cast<std::int64_t>(p.tag);
  row[1] = static_cast<std::int64_t>(p.dtype);
  row[2] = p.numel;
  for (int peer : p.sends) row[kPatternHeader + peer] |= kSends;
  for (int peer : p.receives) row[kPatternHeader + peer] |= kReceives;
  return row;
}

// The mismatches of the gathered table, as sentences (at most `limit`).
inline std::vector<std::string> pattern_mismatches(std::span<const std::int64_t> table, int n,
                                                   std::size_t limit) {
  const int width = kPatternHeader + n;
  auto at = [&](int rank, int column) { return table[rank * width + column]; };
  std::vector<std::string> found;
  auto add = [&](std::string text) {
    if (found.size() < limit) found.push_back(std::move(text));
  };
  for (int r = 1; r < n; ++r) {
    if (at(r, 0) != at(0, 0))
      add(
          fmt::format("rank {} runs another call than rank 0 (name or "
                      "call count differs)",
                      r));
    if (at(r, 1) != at(0, 1)) add(fmt::format("rank {} passes another dtype than rank 0", r));
    if (at(r, 2) != at(0, 2))
      add(fmt::format("rank {} passes {} elements, rank 0 {}", r, at(r, 2), at(0, 2)));
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const bool sends = (at(i, kPatternHeader + j) & kSends) != 0;
      const bool receives = (at(j, kPatternHeader + i) & kReceives) != 0;
      if (sends && !receives) add(fmt::format("rank {} sends to {}, which does not receive", i, j));
      if (!sends && receives)
        add(fmt::format("rank {} receives from {}, which does not send", j, i));
    }
  }
  return found;
}

}  // namespace detail

// Collective over `comm`: throws InvalidArgument on every rank unless every
// send of the pattern has its receive and the ranks agree on tag, dtype and
// (unless -1) element count.
inline void check_neighbor_pattern(Communicator& comm, const NeighborPattern& pattern) {
  const int n = comm.size();
  std::vector<std::int64_t> row = detail::pattern_row(pattern, n);
  std::vector<std::int64_t> table(row.size() * static_cast<std::size_t>(n));
  comm.allgather(TensorView{row.data(), static_cast<std::int64_t>(row.size()), DType::kInt64},
                 TensorView{table.data(), static_cast<std::int64_t>(table.size()), DType::kInt64});
  const auto mismatches = detail::pattern_mismatches(table, n, 6);
  if (mismatches.empty()) return;
  throw InvalidArgument(
      fmt::format("{}: the ranks' send/receive patterns do not match (seen from "
                  "rank {} of {}; nothing was sent): {}",
                  pattern.op, comm.rank(), n, fmt::join(mismatches, "; ")));
}

// Preconditions shared by the ops: ranks within [0, n), not self, no repeats.
inline void check_neighbor_ranks(std::string_view op, std::string_view what,
                                 std::span<const int> ranks, int self, int n) {
  std::vector<bool> seen(static_cast<std::size_t>(n), false);
  for (int r : ranks) {
    BAGUA_CHECK_ARG(r >= 0 && r < n, "{}: {} names rank {}, not a rank of a world of {}", op, what,
                    r, n);
    BAGUA_CHECK_ARG(r != self, "{}: {} names rank {} itself", op, what, r);
    BAGUA_CHECK_ARG(!seen[r], "{}: {} names rank {} twice", op, what, r);
    seen[r] = true;
  }
}

// The data exchange of a neighbour op's call, its errors naming the call
// (`where`). A timeout also says whether the pattern was checked: without
// the check a rank waiting here usually means a peer does not take part (a
// mismatched pattern).
inline void neighbor_send_recv(Communicator& comm, const std::string& where, bool pattern_checked,
                               std::span<const PeerMessage> sends,
                               std::span<const PeerMessage> receives) {
  try {
    comm.send_recv(sends, receives);
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        fmt::format("{}: no matching peer within the timeout (pattern checked: {}); {}", where,
                    pattern_checked, e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: {}", where, e.what()));
  }
}

}  // namespace bagua
