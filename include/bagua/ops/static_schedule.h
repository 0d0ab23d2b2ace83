// Ripples' static schedule: the conflict-free group a rank P-Reduces with at a
// step, computed locally from (rank, step) with no group generator.
//
// Contract: a pure, constexpr function. Every member of the returned group
// computes the same group for the same step (consistency), so the groups of one
// step partition the ranks and can run concurrently. The group is sorted and
// contains `rank`; {rank} alone means "no sync at this step". Period 4.
//
// Rule (design docs/ripples.md, "Static schedule"; reproduces the paper's table
// for local size 4). Nodes are L = local_size consecutive ranks (the last node
// may be smaller); N nodes; rank r is local worker l of node v; phase
// p = step mod 4; pair(a) = {r, local worker a of this node} if it exists,
// else {r}.
//   p = 1, 3: all ranks of node v.
//   p = 0:    l = 0 -> local worker 0 of every node (N ranks); l = 1 -> {r};
//             l >= 2 -> pair(l xor 1).
//   p = 2:    l = 0 -> pair(3); l = 3 -> pair(0); l = 2 -> {r};
//             l >= 4 -> pair(l xor 2);
//             l = 1 -> with local worker 1 of node (v + N'/2) mod N', where
//             N' = N for even N, N - 1 for odd N (node N - 1 sits out when N is
//             odd); {r} when that node has no local worker 1.
// The schedule ignores any group size.
#pragma once

#include <cstdint>
#include <vector>

#include "bagua/core/errors.h"

namespace bagua {

constexpr std::vector<int> static_schedule(int rank, std::int64_t step, int world_size,
                                           int local_size) {
  BAGUA_CHECK_ARG(world_size >= 1, "static_schedule: world_size must be >= 1, got {}", world_size);
  BAGUA_CHECK_ARG(local_size >= 1, "static_schedule: local_size must be >= 1, got {}", local_size);
  BAGUA_CHECK_ARG(rank >= 0 && rank < world_size,
                  "static_schedule: rank must be in [0, world_size = {}), got {}", world_size,
                  rank);
  BAGUA_CHECK_ARG(step >= 0, "static_schedule: step must be >= 0, got {}", step);

  const int nodes = (world_size + local_size - 1) / local_size;
  const int node = rank / local_size;
  const int local = rank % local_size;
  const int node_begin = node * local_size;
  const int node_size = world_size - node_begin < local_size ? world_size - node_begin : local_size;
  const int phase = static_cast<int>(step % 4);

  // {rank, peer} in order.
  const auto with = [rank](int peer) {
    std::vector<int> group{rank, peer};
    if (peer < rank) group = {peer, rank};
    return group;
  };
  // {rank, local worker `other` of this node} when it exists, else {rank}.
  const auto pair = [&](int other) {
    if (other >= node_size) return std::vector<int>{rank};
    return with(node_begin + other);
  };

  if (phase == 1 || phase == 3) {
    std::vector<int> group;
    for (int i = 0; i < node_size; ++i) group.push_back(node_begin + i);
    return group;
  }
  if (phase == 0) {
    if (local == 0) {
      std::vector<int> group;
      for (int v = 0; v < nodes; ++v) group.push_back(v * local_size);
      return group;
    }
    if (local == 1) return std::vector<int>{rank};
    return pair(local ^ 1);
  }
  // phase 2
  if (local == 0) return pair(3);
  if (local == 3) return pair(0);
  if (local == 2) return std::vector<int>{rank};
  if (local >= 4) return pair(local ^ 2);
  // local == 1: the local worker 1 of the opposite node on a ring of N' nodes.
  const int ring = nodes % 2 == 0 ? nodes : nodes - 1;
  if (node >= ring) return std::vector<int>{rank};  // node N - 1 of an odd N sits out
  const int partner_node = (node + ring / 2) % ring;
  if (partner_node == node) return std::vector<int>{rank};
  const int peer = partner_node * local_size + 1;
  if (peer >= world_size) return std::vector<int>{rank};
  return with(peer);
}

}  // namespace bagua
