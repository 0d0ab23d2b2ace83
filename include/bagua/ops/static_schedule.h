// Ripples' static schedule: the conflict-free group a rank P-Reduces with at a
// step, computed locally from (rank, step) with no group generator.
//
// Contract: pure, constexpr functions. Every member of the returned group
// computes the same group for the same step (consistency), so the groups of one
// step partition the ranks and can run concurrently. The group is sorted and
// contains `rank`; {rank} alone means "no sync at this step". Period 4.
//
// Nodes are L = local_size consecutive ranks (the last node may be smaller);
// N nodes; rank r is local worker l of node v; phase p = step mod 4;
// pair(a) = {r, local worker a of this node} if it exists, else {r}.
//
// paper_static_schedule: the paper's table (docs/ripples.md, "Static
// schedule"; reproduces it for local size 4).
//   p = 1, 3: all ranks of node v.
//   p = 0:    l = 0 -> local worker 0 of every node (N ranks); l = 1 -> {r};
//             l >= 2 -> pair(l xor 1).
//   p = 2:    l = 0 -> pair(3); l = 3 -> pair(0); l = 2 -> {r};
//             l >= 4 -> pair(l xor 2);
//             l = 1 -> with local worker 1 of node (v + N'/2) mod N', where
//             N' = N for even N, N - 1 for odd N (node N - 1 sits out when N is
//             odd); {r} when that node has no local worker 1.
//
// static_schedule (what PartialAllReduceAlgorithm runs): the paper's groups,
// with the ranks the table leaves idle put to work across nodes. The table's
// only links between nodes are one group of local workers 0 (phase 0) and
// pairs of local workers 1 (phase 2): at 8 ranks on 2 nodes of 4, the two
// nodes' models drifted apart by up to 5 accuracy points on digits.
//   p = 0, 2: a rank the table leaves alone joins the local worker l of every
//             node whose local worker l the table leaves alone too (the same
//             set from every member: it depends on l and the phase only).
//   p = 1, 3 with local_size 1 (every node one rank, nothing to average
//             inside): a matching, {2j, 2j+1} in phase 1 and {2j+1, 2j+2} in
//             phase 3 (with {n-1, 0} for even n), so that the ranks mix
//             between the global groups of phases 0 and 2.
// Both ignore any group size.
#pragma once

#include <cstdint>
#include <vector>

#include "bagua/core/errors.h"

namespace bagua {

namespace detail {

constexpr void check_static_schedule_args(int rank, std::int64_t step, int world_size,
                                          int local_size) {
  BAGUA_CHECK_ARG(world_size >= 1, "static_schedule: world_size must be >= 1, got {}", world_size);
  BAGUA_CHECK_ARG(local_size >= 1, "static_schedule: local_size must be >= 1, got {}", local_size);
  BAGUA_CHECK_ARG(rank >= 0 && rank < world_size,
                  "static_schedule: rank must be in [0, world_size = {}), got {}", world_size,
                  rank);
  BAGUA_CHECK_ARG(step >= 0, "static_schedule: step must be >= 0, got {}", step);
}

// {a, b} in order.
constexpr std::vector<int> sorted_pair(int a, int b) {
  std::vector<int> group{a, b};
  if (b < a) group = {b, a};
  return group;
}

// The paper's group of `rank` at `phase`; the arguments are valid.
constexpr std::vector<int> paper_group(int rank, int phase, int world_size, int local_size) {
  const int nodes = (world_size + local_size - 1) / local_size;
  const int node = rank / local_size;
  const int local = rank % local_size;
  const int node_begin = node * local_size;
  const int node_size = world_size - node_begin < local_size ? world_size - node_begin : local_size;

  // {rank, local worker `other` of this node} when it exists, else {rank}.
  const auto pair = [&](int other) {
    if (other >= node_size) return std::vector<int>{rank};
    return sorted_pair(rank, node_begin + other);
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
  return sorted_pair(rank, peer);
}

// Phases 0 and 2: the local workers `local` of every node that the paper's
// table leaves alone at `phase` (ascending, so sorted).
constexpr std::vector<int> idle_across_nodes(int local, int phase, int world_size, int local_size) {
  std::vector<int> group;
  for (int peer = local; peer < world_size; peer += local_size) {
    if (paper_group(peer, phase, world_size, local_size).size() == 1) group.push_back(peer);
  }
  return group;
}

// Phases 1 and 3 with one rank per node: the matching of the phase.
constexpr std::vector<int> single_rank_nodes_matching(int rank, int phase, int world_size) {
  int partner = -1;
  if (phase == 1) {
    partner = rank ^ 1;
  } else if (rank % 2 == 1) {
    partner = rank + 1 < world_size ? rank + 1 : (world_size % 2 == 0 ? 0 : -1);
  } else {
    partner = rank > 0 ? rank - 1 : (world_size % 2 == 0 ? world_size - 1 : -1);
  }
  if (partner < 0 || partner >= world_size || partner == rank) return std::vector<int>{rank};
  return sorted_pair(rank, partner);
}

}  // namespace detail

constexpr std::vector<int> paper_static_schedule(int rank, std::int64_t step, int world_size,
                                                 int local_size) {
  detail::check_static_schedule_args(rank, step, world_size, local_size);
  return detail::paper_group(rank, static_cast<int>(step % 4), world_size, local_size);
}

constexpr std::vector<int> static_schedule(int rank, std::int64_t step, int world_size,
                                           int local_size) {
  detail::check_static_schedule_args(rank, step, world_size, local_size);
  const int phase = static_cast<int>(step % 4);
  auto group = detail::paper_group(rank, phase, world_size, local_size);
  if (group.size() > 1) return group;
  if (phase == 0 || phase == 2) {
    return detail::idle_across_nodes(rank % local_size, phase, world_size, local_size);
  }
  if (local_size == 1) return detail::single_rank_nodes_matching(rank, phase, world_size);
  return group;
}

}  // namespace bagua
