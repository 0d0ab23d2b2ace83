// Ripples' static schedule (include/bagua/ops/static_schedule.h): the paper's
// table for 16 ranks on nodes of 4, the schedule that puts its idle ranks to
// work across nodes, and both rules' properties for every world size up to 32
// and several local sizes.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "bagua/ops/static_schedule.h"

using namespace bagua;

namespace {

using Schedule = std::vector<int> (*)(int, std::int64_t, int, int);

// The groups of one step, each once, keyed by their smallest rank.
std::set<std::vector<int>> groups_at(std::int64_t step, int n, int local_size,
                                     Schedule schedule = static_schedule) {
  std::set<std::vector<int>> out;
  for (int r = 0; r < n; ++r) out.insert(schedule(r, step, n, local_size));
  return out;
}

int find(std::vector<int>& parent, int x) {
  while (parent[static_cast<std::size_t>(x)] != x) {
    x = parent[static_cast<std::size_t>(x)] =
        parent[static_cast<std::size_t>(parent[static_cast<std::size_t>(x)])];
  }
  return x;
}

}  // namespace

// Usable in constant expressions (the vector does not outlive the evaluation).
static_assert(static_schedule(0, 0, 16, 4).size() == 4);
static_assert([] {
  const auto group = static_schedule(1, 2, 16, 4);
  return group[1];
}() == 9);
static_assert(static_schedule(5, 1, 6, 3) == std::vector<int>{3, 4, 5});

TEST_CASE("static schedule: the paper's table for 16 ranks on 4 nodes of 4") {
  using G = std::set<std::vector<int>>;
  const G phase0 = {{0, 4, 8, 12}, {2, 3}, {6, 7}, {10, 11}, {14, 15}, {1}, {5}, {9}, {13}};
  const G intra = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}};
  const G phase2 = {{0, 3}, {4, 7}, {8, 11}, {12, 15}, {1, 9}, {5, 13}, {2}, {6}, {10}, {14}};
  for (std::int64_t period = 0; period < 3; ++period) {
    CHECK(groups_at(4 * period + 0, 16, 4, paper_static_schedule) == phase0);
    CHECK(groups_at(4 * period + 1, 16, 4, paper_static_schedule) == intra);
    CHECK(groups_at(4 * period + 2, 16, 4, paper_static_schedule) == phase2);
    CHECK(groups_at(4 * period + 3, 16, 4, paper_static_schedule) == intra);
  }
  // Spot checks as the paper words them.
  CHECK(paper_static_schedule(8, 4, 16, 4) == std::vector<int>{0, 4, 8, 12});
  CHECK(paper_static_schedule(6, 6, 16, 4) == std::vector<int>{6});
  CHECK(paper_static_schedule(9, 1'000'002, 16, 4) == std::vector<int>{1, 9});
}

TEST_CASE("static schedule: the paper's groups, its idle ranks grouped across nodes") {
  using G = std::set<std::vector<int>>;
  // Phase 0 leaves every node's local worker 1 idle in the paper, phase 2 its
  // local worker 2: they average across the nodes.
  const G phase0 = {{0, 4, 8, 12}, {2, 3}, {6, 7}, {10, 11}, {14, 15}, {1, 5, 9, 13}};
  const G intra = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}};
  const G phase2 = {{0, 3}, {4, 7}, {8, 11}, {12, 15}, {1, 9}, {5, 13}, {2, 6, 10, 14}};
  for (std::int64_t period = 0; period < 3; ++period) {
    CHECK(groups_at(4 * period + 0, 16, 4) == phase0);
    CHECK(groups_at(4 * period + 1, 16, 4) == intra);
    CHECK(groups_at(4 * period + 2, 16, 4) == phase2);
    CHECK(groups_at(4 * period + 3, 16, 4) == intra);
  }
  // 8 ranks on 2 nodes of 4 (issue 44's run): four links between the nodes
  // per period instead of two.
  CHECK(groups_at(0, 8, 4) == G{{0, 4}, {1, 5}, {2, 3}, {6, 7}});
  CHECK(groups_at(2, 8, 4) == G{{0, 3}, {4, 7}, {1, 5}, {2, 6}});
  // One rank per node: the global group in phases 0 and 2, matchings between.
  CHECK(groups_at(0, 5, 1) == G{{0, 1, 2, 3, 4}});
  CHECK(groups_at(1, 5, 1) == G{{0, 1}, {2, 3}, {4}});
  CHECK(groups_at(2, 5, 1) == G{{0, 1, 2, 3, 4}});
  CHECK(groups_at(3, 5, 1) == G{{0}, {1, 2}, {3, 4}});
  CHECK(groups_at(3, 4, 1) == G{{0, 3}, {1, 2}});
  CHECK(groups_at(1, 2, 1) == G{{0, 1}});
  CHECK(groups_at(3, 2, 1) == G{{0, 1}});
}

namespace {

// Consistent, sorted, contains the rank, period 4, the union over one period
// connected; returns how many of the 4 phases each rank syncs in.
std::vector<int> check_properties(Schedule schedule, int n, int local_size) {
  std::vector<int> parent(static_cast<std::size_t>(n));
  std::iota(parent.begin(), parent.end(), 0);
  std::vector<int> active_phases(static_cast<std::size_t>(n), 0);
  for (std::int64_t step = 0; step < 8; ++step) {
    for (int r = 0; r < n; ++r) {
      const auto group = schedule(r, step, n, local_size);
      REQUIRE(!group.empty());
      CHECK(std::is_sorted(group.begin(), group.end()));
      CHECK(std::adjacent_find(group.begin(), group.end()) == group.end());
      CHECK(std::find(group.begin(), group.end(), r) != group.end());
      CHECK(group.front() >= 0);
      CHECK(group.back() < n);
      for (int member : group) {  // every member computes the same group
        CHECK(schedule(member, step, n, local_size) == group);
      }
      CHECK(schedule(r, step + 4, n, local_size) == group);
      if (step < 4) {
        if (group.size() >= 2) ++active_phases[static_cast<std::size_t>(r)];
        for (int member : group)
          parent[static_cast<std::size_t>(find(parent, member))] = find(parent, r);
      }
    }
  }
  std::set<int> components;
  for (int r = 0; r < n; ++r) components.insert(find(parent, r));
  CHECK(components.size() == 1);  // the union over one period is connected
  return active_phases;
}

}  // namespace

TEST_CASE("static schedule: consistent, contains the rank, period 4, connected, active") {
  for (int n = 1; n <= 32; ++n) {
    for (int local_size : {1, 2, 3, 4, 5, 8}) {
      CAPTURE(n);
      CAPTURE(local_size);
      const int nodes = (n + local_size - 1) / local_size;
      const bool full_nodes = n % local_size == 0 && local_size >= 2 && nodes >= 2;
      const auto paper = check_properties(paper_static_schedule, n, local_size);
      const auto ours = check_properties(static_schedule, n, local_size);
      for (int r = 0; r < n; ++r) {
        const auto i = static_cast<std::size_t>(r);
        CHECK(ours[i] >= paper[i]);  // putting idle ranks to work only adds syncs
        if (full_nodes) {
          CHECK(paper[i] >= 2);
          CHECK(ours[i] >= 3);
        }
        if (local_size == 1 && n >= 2) CHECK(ours[i] >= 3);
      }
    }
  }
}

TEST_CASE("static schedule: odd node counts and a partial last node") {
  // 3 nodes of 4: node 2 sits out the LW1 exchange of phase 2.
  CHECK(static_schedule(1, 2, 12, 4) == std::vector<int>{1, 5});
  CHECK(static_schedule(9, 2, 12, 4) == std::vector<int>{9});
  // ... and the LW2s, idle in the paper's phase 2, average across all three nodes.
  CHECK(paper_static_schedule(10, 2, 12, 4) == std::vector<int>{10});
  CHECK(static_schedule(10, 2, 12, 4) == std::vector<int>{2, 6, 10});
  // 10 ranks on nodes of 4: the last node {8, 9} has no LW2 or LW3.
  CHECK(static_schedule(8, 0, 10, 4) == std::vector<int>{0, 4, 8});
  CHECK(static_schedule(8, 2, 10, 4) == std::vector<int>{8});  // the only idle LW0
  CHECK(static_schedule(9, 3, 10, 4) == std::vector<int>{8, 9});
  // 9 ranks on nodes of 4: three nodes, so node 2 = {8} sits out; nodes 0 and 1 pair.
  CHECK(static_schedule(1, 2, 9, 4) == std::vector<int>{1, 5});
  // Local workers >= 4 pair by xor 1 (phase 0) and xor 2 (phase 2).
  CHECK(static_schedule(4, 0, 8, 8) == std::vector<int>{4, 5});
  CHECK(static_schedule(4, 2, 8, 8) == std::vector<int>{4, 6});
  CHECK(static_schedule(7, 2, 8, 8) == std::vector<int>{5, 7});
  // One node: phase 0 and 2 keep LW1 alone; world size 1 is always alone.
  CHECK(static_schedule(1, 2, 4, 4) == std::vector<int>{1});
  CHECK(static_schedule(0, 0, 1, 1) == std::vector<int>{0});
  // local_size 1: every rank is a node's LW0, so phase 0 is the global group.
  CHECK(static_schedule(2, 0, 3, 1) == std::vector<int>{0, 1, 2});
}

TEST_CASE("static schedule: invalid arguments name the argument and the value") {
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  CHECK(message([] { static_schedule(4, 0, 4, 2); }).find("rank") != std::string::npos);
  CHECK(message([] { static_schedule(4, 0, 4, 2); }).find("got 4") != std::string::npos);
  CHECK(message([] { static_schedule(-1, 0, 4, 2); }).find("got -1") != std::string::npos);
  CHECK(message([] { static_schedule(0, -3, 4, 2); }).find("step must be >= 0, got -3") !=
        std::string::npos);
  CHECK(message([] { static_schedule(0, 0, 0, 2); }).find("world_size must be >= 1, got 0") !=
        std::string::npos);
  CHECK(message([] { static_schedule(0, 0, 4, 0); }).find("local_size must be >= 1, got 0") !=
        std::string::npos);
}
