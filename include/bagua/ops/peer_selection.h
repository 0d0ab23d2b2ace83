// Who a rank exchanges weights with in decentralized communication.
//
// - kAll: every rank (the global average).
// - kShiftOne: one partner per communication step s, changing every step;
//   for even n, with h = n / 2:
//     rank <  h: peer = ((s + rank) mod h) + h
//     rank >= h: peer = (rank - h - s) mod h        (Euclidean mod)
//   which pairs every rank with a partner that names it back. For odd n the
//   same formula runs over n + 1 ranks with a virtual last rank; the rank
//   paired with it sits the step out (keeps its own weights). That rank is
//   one of the lower (n + 1) / 2 ranks, each in turn: every step all other
//   ranks average in pairs.
// - kRing: both ring neighbours (rank - 1 and rank + 1 mod n).
#pragma once

#include <cstdint>
#include <string_view>

#include "bagua/core/errors.h"

namespace bagua {

enum class PeerSelection : std::uint8_t { kAll, kShiftOne, kRing };

constexpr std::string_view to_string(PeerSelection mode) {
  switch (mode) {
    case PeerSelection::kAll: return "all";
    case PeerSelection::kShiftOne: return "shift_one";
    case PeerSelection::kRing: return "ring";
  }
  return "unknown";
}

inline PeerSelection parse_peer_selection(std::string_view name) {
  for (auto mode : {PeerSelection::kAll, PeerSelection::kShiftOne, PeerSelection::kRing}) {
    if (to_string(mode) == name) return mode;
  }
  throw InvalidArgument(
      fmt::format("unknown peer_selection_mode '{}' (supported: all, shift_one, ring)", name));
}

// The shift_one partner of `rank` among `size` ranks at communication step
// `step`, or -1 when the rank sits this step out (odd sizes only, and size 1).
constexpr int shift_one_peer(int rank, int size, std::int64_t step) {
  const int n = size % 2 == 0 ? size : size + 1;  // a virtual rank makes n even
  const int half = n / 2;
  const auto mod = [](std::int64_t a, std::int64_t m) { return ((a % m) + m) % m; };
  const int peer = rank < half ? static_cast<int>(mod(step + rank, half)) + half
                               : static_cast<int>(mod(rank - half - step, half));
  return peer >= size ? -1 : peer;
}

}  // namespace bagua
