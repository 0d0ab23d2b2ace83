// The group generator engine (include/bagua/runtime/group_generator.h), rule
// by rule: options, the partition sizes of a global division, the paper's
// 4-worker example, the slowdown filter, inter-intra phases and id order,
// random-mode granting without overtaking, leave and drain, linger, misuse errors and
// determinism. The discrete-event simulation is test_group_generator_sim.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "bagua/runtime/group_generator.h"

using namespace bagua;

namespace {

using Ranks = std::vector<int>;

GroupGeneratorOptions options(int n, int k, GroupGenerationMode mode, std::uint64_t seed = 0) {
  GroupGeneratorOptions o;
  o.world_size = n;
  o.group_size = k;
  o.mode = mode;
  o.seed = seed;
  return o;
}

GroupGeneratorOptions smart(int n, int k, std::uint64_t seed = 0) {
  return options(n, k, GroupGenerationMode::kSmart, seed);
}

GroupGeneratorOptions random_mode(int n, int k, std::uint64_t seed = 0) {
  return options(n, k, GroupGenerationMode::kRandom, seed);
}

// The group of a reply that must be a group.
Group group_of(const GroupReply& reply) {
  REQUIRE(reply.kind == ReplyKind::kGroup);
  return reply.group;
}

// Request, then complete at once: the group the rank got.
Group run_once(GroupGeneratorEngine& engine, int rank) {
  const Group g = group_of(engine.request(rank));
  engine.complete(rank, g.id);
  return g;
}

bool contains(const Ranks& ranks, int rank) {
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

template <typename F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no InvalidArgument";
}

}  // namespace

TEST_CASE("group generator: options are validated, naming the field and the value") {
  CHECK(error_of([] {
          GroupGeneratorEngine e(smart(0, 3));
        }).find("world_size must be >= 1, got 0") != std::string::npos);
  CHECK(error_of([] {
          GroupGeneratorEngine e(smart(4, 1));
        }).find("group_size must be >= 2, got 1") != std::string::npos);
  auto o = smart(4, 3);
  o.slowdown_threshold = 0;
  CHECK(error_of([&] {
          GroupGeneratorEngine e(o);
        }).find("slowdown_threshold must be >= 1, got 0") != std::string::npos);
  o = random_mode(4, 3);
  o.slowdown_threshold = 5;
  CHECK(error_of([&] {
          GroupGeneratorEngine e(o);
        }).find("slowdown_threshold = 5 needs mode 'smart'") != std::string::npos);
  o = random_mode(4, 3);
  o.inter_intra = true;
  CHECK(error_of([&] {
          GroupGeneratorEngine e(o);
        }).find("inter_intra = true needs mode 'smart'") != std::string::npos);
  o = smart(4, 3);
  o.local_size = 0;
  CHECK(error_of([&] { GroupGeneratorEngine e(o); }).find("local_size must be >= 1, got 0") !=
        std::string::npos);
  o = smart(4, 3);
  o.company_every = -1;
  CHECK(error_of([&] { GroupGeneratorEngine e(o); }).find("company_every must be >= 0, got -1") !=
        std::string::npos);
  CHECK(parse_group_generation_mode("random") == GroupGenerationMode::kRandom);
  CHECK(parse_group_generation_mode("smart") == GroupGenerationMode::kSmart);
  CHECK(error_of([] { parse_group_generation_mode("static"); }).find("'static'") !=
        std::string::npos);
  CHECK(to_string(GroupGenerationMode::kSmart) == "smart");
  CHECK(to_string(ReplyKind::kDone) == "done");
  // k above the world size is allowed (the algorithm decides whether to refuse it).
  GroupGeneratorEngine big(smart(2, 5));
  CHECK(group_of(big.request(0)).ranks == Ranks{0, 1});
}

TEST_CASE("group generator: a global division makes ceil(|F|/k) groups of balanced sizes") {
  for (int n = 1; n <= 20; ++n) {
    for (int k = 2; k <= 6; ++k) {
      CAPTURE(n);
      CAPTURE(k);
      GroupGeneratorEngine engine(smart(n, k, static_cast<std::uint64_t>(n * 10 + k)));
      const Group first = group_of(engine.request(n / 2));
      CHECK(contains(first.ranks, n / 2));
      // Every rank now holds exactly one group: the requester's is executing.
      std::set<std::uint64_t> ids;
      std::multiset<std::size_t> sizes;
      std::vector<int> seen(static_cast<std::size_t>(n), 0);
      for (int r = 0; r < n; ++r) {
        const auto buffered = engine.buffer(r);
        const Group g = r == n / 2 ? *engine.executing(r) : buffered.at(0);
        CHECK(buffered.size() == (r == n / 2 ? 0u : 1u));
        CHECK(contains(g.ranks, r));
        CHECK(std::is_sorted(g.ranks.begin(), g.ranks.end()));
        if (ids.insert(g.id).second) {
          sizes.insert(g.ranks.size());
          for (int m : g.ranks) ++seen[static_cast<std::size_t>(m)];
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));  // a partition
      const std::size_t count = static_cast<std::size_t>((n + k - 1) / k);
      CHECK(ids.size() == count);
      CHECK(*ids.begin() == 1);
      CHECK(*ids.rbegin() == count);  // consecutive ids
      CHECK(*sizes.rbegin() <= static_cast<std::size_t>(k));
      CHECK(*sizes.rbegin() - *sizes.begin() <= 1);
      const bool singleton_allowed = n == 1 || (k == 2 && n % 2 == 1);
      CHECK((*sizes.begin() == 1) == singleton_allowed);
      // The section-3 pitfall: 4 idle ranks with k = 3 are two pairs.
      if (n == 4 && k == 3) CHECK(sizes == std::multiset<std::size_t>{2, 2});
      const auto s = engine.stats();
      CHECK(s.groups == static_cast<std::int64_t>(count));
      CHECK(s.divisions == 1);
      CHECK(s.requests == 1);
      CHECK(s.max_buffer_len == 1);
      CHECK(s.mean_group_size == doctest::Approx(static_cast<double>(n) / count));
    }
  }
}

TEST_CASE("group generator: the paper's 4-worker global division example") {
  GroupGeneratorEngine engine(smart(4, 2, 7));
  const Group g0 = group_of(engine.request(0));
  CHECK(g0.ranks.size() == 2);
  CHECK(contains(g0.ranks, 0));
  // The other two ranks were paired in the same division.
  const int partner = g0.ranks[0] == 0 ? g0.ranks[1] : g0.ranks[0];
  Ranks others;
  for (int r = 1; r < 4; ++r) {
    if (r != partner) others.push_back(r);
  }
  const std::uint64_t other_id = g0.id == 1 ? 2 : 1;  // ids 1 and 2, in shuffle order
  CHECK(engine.buffer(others[0]) == std::vector<Group>{Group{.id = other_id, .ranks = others}});
  CHECK(engine.buffer(partner) == std::vector<Group>{g0});
  CHECK(engine.lock_vector() == std::vector<bool>{true, true, true, true});
  // W3's later request gets its group from its buffer, with no new division.
  const Group g3 = group_of(engine.request(3));
  CHECK(g3 == engine.executing(3));
  CHECK(engine.buffer(3).empty());
  CHECK(engine.stats().divisions == 1);
  CHECK(engine.counters() == std::vector<std::int64_t>{1, 0, 0, 1});
  engine.complete(0, g0.id);
  CHECK(engine.lock_vector()[0] == false);
}

TEST_CASE("group generator: the slowdown filter keeps ranks that lag by C_thres requests out") {
  for (bool filter : {false, true}) {
    CAPTURE(filter);
    auto o = smart(3, 3, 1);
    if (filter) o.slowdown_threshold = 2;
    GroupGeneratorEngine engine(o);
    CHECK(run_once(engine, 0).ranks == Ranks{0, 1, 2});  // counters 1 0 0
    CHECK(run_once(engine, 1).ranks == Ranks{0, 1, 2});  // 1 1 0; rank 2 still holds it
    CHECK(run_once(engine, 0).ranks == Ranks{0, 1});     // 2 1 0: rank 2 is not idle
    CHECK(run_once(engine, 1).ranks == Ranks{0, 1});     // 2 2 0
    CHECK(run_once(engine, 2).ranks == Ranks{0, 1, 2});  // 2 2 1: rank 2 catches up, idle again
    // Rank 0's counter is 3 now: 3 - 2 < 2 keeps rank 1; 3 - 1 >= 2 drops rank 2.
    const Group g = group_of(engine.request(0));
    CHECK(g.ranks == (filter ? Ranks{0, 1} : Ranks{0, 1, 2}));
    CHECK(engine.counters() == std::vector<std::int64_t>{3, 2, 1});
    if (filter) {
      // A slow initiator still takes fast idle ranks: rank 2 requests alone
      // (ranks 0 and 1 are busy), then again once they are idle.
      CHECK(run_once(engine, 2).ranks == Ranks{2});
      engine.complete(0, g.id);
      CHECK(run_once(engine, 1).id == g.id);
      CHECK(run_once(engine, 2).ranks == Ranks{0, 1, 2});  // c2 = 3: c2 - c_w <= 0
      CHECK(engine.stats().solo == 1);
    }
  }
}

// Ranks 0 and 1 take a group together; rank 2, idle, is filtered out.
Group fast_pair(GroupGeneratorEngine& engine) {
  const Group fast = group_of(engine.request(0));
  CHECK(fast.ranks == Ranks{0, 1});
  CHECK(group_of(engine.request(1)) == fast);
  return fast;
}

// Ranks 0 and 1 (C_thres = 2) run ahead of rank 2 while it executes the
// first group; then both hold a new group (executing, queues empty), and
// rank 2, behind, requests alone. Returns the fast ranks' group.
Group fast_ranks_ahead(GroupGeneratorEngine& engine) {
  const Group first = group_of(engine.request(2));  // {0, 1, 2}: rank 2 keeps executing it
  REQUIRE(first.ranks == Ranks{0, 1, 2});
  for (int round = 0; round < 3; ++round) {  // counters 3 3 1
    run_once(engine, 0);
    run_once(engine, 1);
  }
  engine.complete(2, first.id);
  return fast_pair(engine);
}

TEST_CASE("group generator: a behind rank alone gets a busy companion (bounded isolation, I6)") {
  for (int every : {0, 1, 2}) {
    CAPTURE(every);
    auto o = smart(3, 3, 5);
    o.slowdown_threshold = 2;
    o.company_every = every;
    GroupGeneratorEngine engine(o);
    Group fast = fast_ranks_ahead(engine);
    Group g = group_of(engine.request(2));
    CHECK(engine.counters() == std::vector<std::int64_t>{4, 4, 2});
    if (every != 1) {
      // The paper's rule (K = 0), and K = 2 after a group with company: alone.
      CHECK(g.ranks == Ranks{2});
      CHECK(engine.stats().company == 0);
      if (every == 0) continue;
      // K = 2: alone in the last group, alone again now: company.
      engine.complete(2, g.id);
      engine.complete(0, fast.id);
      engine.complete(1, fast.id);
      fast = fast_pair(engine);
      g = group_of(engine.request(2));
      CHECK(engine.counters() == std::vector<std::int64_t>{5, 5, 3});
    }
    // One companion, busy and with an empty queue: it gets the group after
    // the one it executes (the largest id yet), and runs it next.
    REQUIRE(g.ranks.size() == 2);
    CHECK(g.ranks.back() == 2);
    const int w = g.ranks.front();
    CHECK(g.id > fast.id);
    CHECK(engine.executing(w) == fast);
    CHECK(engine.buffer(w) == std::vector<Group>{g});
    CHECK(engine.stats().company == 1);
    CHECK(engine.stats().solo == (every == 2 ? 1 : 0));
    engine.complete(w, fast.id);
    CHECK(run_once(engine, w) == g);
    engine.complete(2, g.id);
    CHECK(engine.drained() == false);  // the other fast rank still executes `fast`
    engine.complete(1 - w, fast.id);
    CHECK(engine.drained());
  }
}

TEST_CASE("group generator: a companion has room in its buffer; none without a threshold") {
  auto o = smart(3, 3, 5);
  o.slowdown_threshold = 2;
  GroupGeneratorEngine engine(o);
  const Group fast = fast_ranks_ahead(engine);
  engine.complete(0, fast.id);
  engine.complete(1, fast.id);
  // Rank 0 executes a new group; rank 1 holds it queued: no room at rank 1.
  const Group next = group_of(engine.request(0));
  CHECK(next.ranks == Ranks{0, 1});
  const Group g = group_of(engine.request(2));
  CHECK(g.ranks == Ranks{0, 2});
  CHECK(engine.buffer(0) == std::vector<Group>{g});
  CHECK(engine.buffer(1) == std::vector<Group>{next});
  // Without a threshold nobody is behind: the paper's rule, alone.
  GroupGeneratorEngine plain(smart(3, 3, 5));
  const Group first = group_of(plain.request(2));
  for (int round = 0; round < 3; ++round) {
    run_once(plain, 0);
    run_once(plain, 1);
  }
  plain.complete(2, first.id);
  CHECK(group_of(plain.request(0)).ranks == Ranks{0, 1, 2});  // no filter: rank 2 joins
  CHECK(group_of(plain.request(1)).ranks == Ranks{0, 1, 2});
  CHECK(plain.stats().company == 0);
}

TEST_CASE("group generator: inter-intra gives a behind head a companion of another node") {
  for (int every : {0, 1}) {
    CAPTURE(every);
    auto o = smart(8, 3, 9);
    o.local_size = 4;
    o.inter_intra = true;
    o.slowdown_threshold = 2;
    o.company_every = every;
    GroupGeneratorEngine engine(o);
    engine.complete(7, group_of(engine.request(7)).id);  // inter phase
    const Group first = group_of(engine.request(7));     // intra: rank 7 keeps executing it
    for (int round = 0; round < 4; ++round) {
      for (int r = 0; r < 7; ++r) {
        if (engine.executing(r)) engine.complete(r, engine.executing(r)->id);
        run_once(engine, r);
      }
    }
    engine.complete(7, first.id);
    for (int r = 0; r < 7; ++r) group_of(engine.request(r));  // every fast rank busy
    const Group g = group_of(engine.request(7));              // behind, alone: its node's head
    if (every == 0) {
      // The paper's rule: alone in both phases (two groups of one).
      CHECK(g.ranks == Ranks{7});
      CHECK(engine.buffer(7) == std::vector<Group>{Group{.id = g.id + 1, .ranks = {7}}});
      continue;
    }
    REQUIRE(g.ranks.size() == 2);
    const int w = g.ranks.front();
    CHECK(w / 4 == 0);                // one rank per node, as every inter-phase group
    CHECK(engine.buffer(7).empty());  // no intra-phase group behind its next request
    const auto queued = engine.buffer(w);
    REQUIRE(!queued.empty());
    CHECK(queued.back() == g);
    CHECK(queued.size() <= 2);
    // The companion had the shortest queue among node 0's busy ranks.
    for (int r = 0; r < 4; ++r) {
      if (r != w) CHECK(engine.buffer(r).size() + 1 >= queued.size());
    }
    CHECK(engine.stats().max_buffer_len <= 2);
  }
}

TEST_CASE("group generator: inter-intra phases, heads and id order") {
  for (int n : {8, 10, 12, 13}) {
    for (int k : {2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(k);
      auto o = smart(n, k, static_cast<std::uint64_t>(n + k));
      o.local_size = 4;
      o.inter_intra = true;
      GroupGeneratorEngine engine(o);
      const Group first = group_of(engine.request(5));
      const int nodes = (n + 3) / 4;
      // Every rank holds two groups: inter phase, then intra phase.
      std::vector<Group> inter, intra;
      std::set<std::uint64_t> inter_ids, intra_ids;
      for (int r = 0; r < n; ++r) {
        auto queue = engine.buffer(r);
        if (r == 5) queue.insert(queue.begin(), first);
        REQUIRE(queue.size() == 2);
        CHECK(queue[0].id < queue[1].id);
        if (inter_ids.insert(queue[0].id).second) inter.push_back(queue[0]);
        if (intra_ids.insert(queue[1].id).second) intra.push_back(queue[1]);
      }
      CHECK(*inter_ids.rbegin() < *intra_ids.begin());  // all inter ids first
      CHECK(engine.stats().max_buffer_len == 2);
      // Intra phase: exactly the nodes, in node order.
      REQUIRE(intra.size() == static_cast<std::size_t>(nodes));
      for (int v = 0; v < nodes; ++v) {
        Ranks node;
        for (int r = 4 * v; r < std::min(n, 4 * v + 4); ++r) node.push_back(r);
        CHECK(intra[static_cast<std::size_t>(v)].ranks == node);
      }
      std::sort(inter.begin(), inter.end(), [](auto& a, auto& b) { return a.id < b.id; });
      // Inter phase: the head group(s) first (one rank per node), then per
      // node the other ranks, in node order.
      std::set<int> heads;
      std::size_t at = 0;
      const std::size_t head_groups = static_cast<std::size_t>((nodes + k - 1) / k);
      for (; at < head_groups; ++at) {
        std::set<int> nodes_seen;
        for (int r : inter[at].ranks) {
          CHECK(nodes_seen.insert(r / 4).second);  // at most one rank per node
          heads.insert(r);
        }
        CHECK(inter[at].ranks.size() <= static_cast<std::size_t>(k));
      }
      CHECK(heads.size() == static_cast<std::size_t>(nodes));
      int last_node = -1;
      for (; at < inter.size(); ++at) {
        const int node = inter[at].ranks.front() / 4;
        CHECK(node >= last_node);
        last_node = node;
        for (int r : inter[at].ranks) {
          CHECK(r / 4 == node);  // intra-node
          CHECK(heads.count(r) == 0);
        }
        CHECK(inter[at].ranks.size() <= static_cast<std::size_t>(k));
      }
    }
  }
}

TEST_CASE("group generator: inter-intra with the filter uses only the filtered idle ranks") {
  auto o = smart(8, 3, 3);
  o.local_size = 4;
  o.inter_intra = true;
  o.slowdown_threshold = 1;  // only ranks with c_w >= c_i join
  GroupGeneratorEngine engine(o);
  const Group first = group_of(engine.request(0));  // c0 = 1, everyone else 0: alone
  CHECK(first.ranks == Ranks{0});
  CHECK(engine.buffer(0) == std::vector<Group>{Group{.id = 2, .ranks = {0}}});
  CHECK(engine.stats().solo == 2);
  CHECK(engine.buffer(1).empty());
}

TEST_CASE("group generator: random mode grants in creation order, without overtaking") {
  int scenarios = 0;
  for (std::uint64_t seed = 0; seed < 64 && scenarios < 3; ++seed) {
    CAPTURE(seed);
    GroupGeneratorEngine engine(random_mode(4, 3, seed));
    const Group g1 = group_of(engine.request(0));  // all unlocked: granted at once
    CHECK(g1.id == 1);
    CHECK(g1.ranks.size() == 3);
    int c = 0;
    while (contains(g1.ranks, c)) ++c;
    CHECK(engine.request(c).kind == ReplyKind::kWait);  // its group needs locked ranks
    REQUIRE(engine.pending().size() == 1);
    const Ranks p1 = engine.pending()[0].ranks;
    Ranks xy;
    for (int r : p1) {
      if (r != c) xy.push_back(r);
    }
    const int x = xy[0], y = xy[1];
    int w = 0;
    while (contains(p1, w)) ++w;  // the G1 member outside P1
    // w and y finish G1; x still holds it, so P1 stays blocked.
    for (int r : {w, y}) {
      if (r != 0) CHECK(group_of(engine.request(r)) == g1);
      engine.complete(r, g1.id);
    }
    CHECK(engine.pending().size() == 1);
    const auto reply = engine.request(w);
    Ranks wcy{w, c, y};
    std::sort(wcy.begin(), wcy.end());
    REQUIRE(engine.pending().size() == 2);
    if (engine.pending()[1].ranks != wcy) continue;  // w drew x: not the overtaking situation
    ++scenarios;
    // P2 = {w, c, y}: all unlocked, but c and y wait in the earlier P1.
    CHECK(reply.kind == ReplyKind::kWait);
    CHECK(engine.waiting() == Ranks{std::min(c, w), std::max(c, w)});
    // x finishes G1: P1 is granted (id 2), P2 now waits for P1's members.
    if (x != 0) CHECK(group_of(engine.request(x)) == g1);
    engine.complete(x, g1.id);
    const Group granted = group_of(engine.poll(c));
    CHECK(granted.ranks == p1);
    CHECK(granted.id == 2);
    CHECK(engine.poll(w).kind == ReplyKind::kWait);
    for (int r : p1) {
      if (r != c) CHECK(group_of(engine.request(r)) == granted);
      engine.complete(r, granted.id);
    }
    const Group second = group_of(engine.poll(w));
    CHECK(second.id == 3);
    CHECK(engine.lock_vector()[static_cast<std::size_t>(x)] == false);
  }
  CHECK(scenarios > 0);
}

TEST_CASE("group generator: random mode holds at most one granted group per rank") {
  GroupGeneratorEngine engine(random_mode(3, 3, 5));
  const Group g1 = group_of(engine.request(0));
  CHECK(g1.ranks == Ranks{0, 1, 2});
  CHECK(engine.lock_vector() == std::vector<bool>{true, true, true});
  engine.complete(0, g1.id);
  CHECK(engine.request(0).kind == ReplyKind::kWait);  // 1 and 2 still hold g1
  CHECK(engine.poll(0).kind == ReplyKind::kWait);
  CHECK(engine.buffer(1) == std::vector<Group>{g1});
  CHECK(run_once(engine, 1) == g1);
  CHECK(group_of(engine.request(2)) == g1);
  // Rank 1 is in rank 0's pending group: it waits for it, drawing nothing new.
  CHECK(engine.request(1).kind == ReplyKind::kWait);
  CHECK(engine.pending().size() == 1);
  engine.complete(2, g1.id);  // frees everyone: the pending group is granted
  const Group g2 = group_of(engine.poll(0));
  CHECK(g2.id == 2);
  CHECK(group_of(engine.poll(1)) == g2);
  CHECK(engine.waiting().empty());
  CHECK(engine.stats().max_buffer_len == 1);
  CHECK(engine.stats().groups == 2);
  CHECK(engine.counters() == std::vector<std::int64_t>{2, 2, 1});
}

TEST_CASE("group generator: a left rank drains its queue, then gets DONE (smart)") {
  GroupGeneratorEngine engine(smart(3, 3, 2));
  const Group g = run_once(engine, 0);
  CHECK(g.ranks == Ranks{0, 1, 2});
  engine.leave(1);
  engine.leave(1);  // idempotent
  CHECK(engine.has_left(1));
  CHECK(run_once(engine, 1) == g);  // drains what it was given
  CHECK(engine.request(1).kind == ReplyKind::kDone);
  CHECK(engine.request(1).kind == ReplyKind::kDone);
  CHECK(run_once(engine, 2) == g);
  CHECK(engine.drained());
  // Never chosen again.
  for (int i = 0; i < 5; ++i) CHECK(!contains(run_once(engine, i % 2 == 0 ? 0 : 2).ranks, 1));
  CHECK(engine.lock_vector()[1] == false);
  // Left with a queued group from someone else's division: drained too.
  GroupGeneratorEngine e2(smart(2, 2));
  const Group h = group_of(e2.request(0));
  e2.leave(1);
  CHECK(group_of(e2.request(1)) == h);
  e2.complete(1, h.id);
  CHECK(e2.request(1).kind == ReplyKind::kDone);
  e2.complete(0, h.id);
  CHECK(run_once(e2, 0).ranks == Ranks{0});  // alone now
  CHECK(e2.drained());
}

TEST_CASE("group generator: leaving in random mode shrinks or drops pending groups") {
  // A member leaves: the pending group shrinks to its initiator, granted as a solo.
  GroupGeneratorEngine engine(random_mode(2, 2));
  const Group g1 = run_once(engine, 0);
  CHECK(g1.ranks == Ranks{0, 1});
  CHECK(engine.request(0).kind == ReplyKind::kWait);  // rank 1 still holds g1
  engine.leave(1);
  const Group solo = group_of(engine.poll(0));
  CHECK(solo.ranks == Ranks{0});
  CHECK(run_once(engine, 1) == g1);  // rank 1 drains
  CHECK(engine.request(1).kind == ReplyKind::kDone);
  engine.complete(0, solo.id);
  CHECK(run_once(engine, 0).ranks == Ranks{0});  // nobody else to draw
  CHECK(engine.stats().solo == 2);
  CHECK(engine.drained());

  // The initiator leaves while waiting: its group is dropped, its poll says DONE.
  GroupGeneratorEngine e2(random_mode(3, 2, 4));
  const Group h = group_of(e2.request(0));
  int other = 0;
  while (contains(h.ranks, other)) ++other;
  const int partner = h.ranks[0] == 0 ? h.ranks[1] : h.ranks[0];
  // `other` draws 0 or `partner`, both locked.
  CHECK(e2.request(other).kind == ReplyKind::kWait);
  CHECK(e2.pending().size() == 1);
  e2.leave(other);
  CHECK(e2.pending().empty());
  CHECK(e2.poll(other).kind == ReplyKind::kDone);
  CHECK(e2.waiting().empty());
  e2.complete(0, h.id);
  CHECK(run_once(e2, partner) == h);
  CHECK(e2.drained());
  CHECK(!contains(run_once(e2, 0).ranks, other));
}

TEST_CASE(
    "group generator: a lingering rank is still chosen, creates nothing, leaves with the last") {
  for (auto mode : {GroupGenerationMode::kSmart, GroupGenerationMode::kRandom}) {
    CAPTURE(to_string(mode));
    auto o = options(3, 3, mode, 5);
    if (mode == GroupGenerationMode::kSmart) o.slowdown_threshold = 2;  // skips lingerers
    GroupGeneratorEngine engine(o);
    engine.linger(0);
    engine.linger(0);  // idempotent
    CHECK(engine.is_lingering(0));
    CHECK(engine.request(0).kind == ReplyKind::kWait);  // asks for nothing of its own
    CHECK(engine.stats().groups == 0);
    // The others still choose it, however far its counter lags.
    for (int round = 0; round < 3; ++round) {
      const Group g = group_of(engine.request(1));
      CHECK(g.ranks == Ranks{0, 1, 2});
      CHECK(engine.poll(0) == GroupReply{.kind = ReplyKind::kGroup, .group = g});
      CHECK(group_of(engine.request(2)) == g);
      for (int r : g.ranks) engine.complete(r, g.id);
      CHECK(engine.request(0).kind == ReplyKind::kWait);
      CHECK(!engine.has_left(0));
    }
    CHECK(engine.counters() == std::vector<std::int64_t>{0, 3, 3});  // lingering is not training
    // Rank 2 leaves outright; rank 1 lingers last: everyone leaves.
    engine.leave(2);
    CHECK(group_of(engine.request(1)).ranks == Ranks{0, 1});
    CHECK(group_of(engine.poll(0)).ranks == Ranks{0, 1});
    engine.complete(0, engine.executing(0)->id);
    engine.complete(1, engine.executing(1)->id);
    CHECK(engine.request(0).kind == ReplyKind::kWait);
    engine.linger(1);
    CHECK(engine.has_left(0));
    CHECK(engine.has_left(1));
    CHECK(!engine.is_lingering(1));
    CHECK(engine.poll(0).kind == ReplyKind::kDone);
    CHECK(engine.request(1).kind == ReplyKind::kDone);
    CHECK(engine.waiting().empty());
    CHECK(engine.drained());
    CHECK(!engine.final_round_id());  // rank 2 left first: no final round together
  }
}

TEST_CASE("group generator: every rank lingering to the end names a final round id") {
  GroupGeneratorEngine engine(options(4, 2, GroupGenerationMode::kSmart, 3));
  std::uint64_t last_id = 0;
  for (int round = 0; round < 3; ++round) {
    for (int r = 0; r < 4; ++r) {
      const Group g = group_of(engine.request(r));  // smart always answers
      last_id = std::max(last_id, g.id);
      engine.complete(r, g.id);
    }
  }
  for (int r = 0; r < 4; ++r) {  // drain what the last divisions queued
    while (!engine.buffer(r).empty()) {
      const Group g = group_of(engine.request(r));
      last_id = std::max(last_id, g.id);
      engine.complete(r, g.id);
    }
  }
  for (int r = 0; r < 3; ++r) {
    engine.linger(r);
    CHECK(!engine.final_round_id());  // rank 3 still trains
  }
  engine.linger(3);
  REQUIRE(engine.final_round_id());
  CHECK(*engine.final_round_id() == last_id + 1);  // above every group's id
  // Random mode, no group ever: the first id.
  GroupGeneratorEngine quiet(options(3, 2, GroupGenerationMode::kRandom));
  for (int r = 0; r < 3; ++r) quiet.linger(r);
  CHECK(quiet.final_round_id() == std::optional<std::uint64_t>{1});
}

TEST_CASE("group generator: misuse raises InvalidArgument naming the rank and the group") {
  for (auto mode : {GroupGenerationMode::kRandom, GroupGenerationMode::kSmart}) {
    CAPTURE(to_string(mode));
    // k = n: every group is everyone, so rank 0's second request waits (random).
    GroupGeneratorEngine engine(options(3, 3, mode));
    CHECK(error_of([&] { engine.request(3); }).find("rank must be in [0, world_size = 3), got 3") !=
          std::string::npos);
    CHECK(error_of([&] { engine.request(-1); }).find("got -1") != std::string::npos);
    CHECK(error_of([&] { engine.complete(7, 1); }).find("got 7") != std::string::npos);
    CHECK(error_of([&] { engine.leave(3); }).find("got 3") != std::string::npos);
    CHECK(error_of([&] { engine.buffer(3); }).find("got 3") != std::string::npos);
    CHECK(error_of([&] { engine.poll(3); }).find("got 3") != std::string::npos);
    CHECK(error_of([&] {
            engine.complete(0, 1);
          }).find("rank 0 is not executing group 1 (executing: none)") != std::string::npos);
    CHECK(error_of([&] { engine.poll(0); }).find("rank 0 has no outstanding request") !=
          std::string::npos);
    const Group g = group_of(engine.request(0));
    CHECK(error_of([&] {
            engine.request(0);
          }).find(fmt::format("rank 0 is still executing group {}", g.id)) != std::string::npos);
    CHECK(error_of([&] { engine.complete(0, g.id + 1); })
              .find(fmt::format("rank 0 is not executing group {} (executing: group {})", g.id + 1,
                                g.id)) != std::string::npos);
    CHECK(error_of([&] { engine.poll(0); }).find("no outstanding request (executing: group") !=
          std::string::npos);
    engine.complete(0, g.id);
    CHECK(error_of([&] { engine.complete(0, g.id); }).find("is not executing") !=
          std::string::npos);
    if (mode == GroupGenerationMode::kRandom) {
      CHECK(engine.request(0).kind == ReplyKind::kWait);
      CHECK(error_of([&] { engine.request(0); }).find("already has an outstanding request") !=
            std::string::npos);
    }
    // A failed call changes nothing.
    CHECK(engine.counters()[0] == (mode == GroupGenerationMode::kRandom ? 2 : 1));
  }
}

namespace {

// A fixed script of requests and completions on 6 ranks; every reply, in order.
std::vector<GroupReply> script(GroupGeneratorOptions options) {
  GroupGeneratorEngine engine(options);
  std::vector<GroupReply> replies;
  std::vector<std::uint64_t> executing(6, 0);
  std::vector<bool> waiting(6, false);
  for (int t = 0; t < 300; ++t) {
    const int r = (t * 7 + t / 5) % 6;
    if (executing[static_cast<std::size_t>(r)] != 0) {
      engine.complete(r, executing[static_cast<std::size_t>(r)]);
      executing[static_cast<std::size_t>(r)] = 0;
      continue;
    }
    if (t == 200) engine.leave(r);
    auto reply = waiting[static_cast<std::size_t>(r)] ? engine.poll(r) : engine.request(r);
    waiting[static_cast<std::size_t>(r)] = reply.kind == ReplyKind::kWait;
    if (reply.kind == ReplyKind::kGroup) executing[static_cast<std::size_t>(r)] = reply.group.id;
    replies.push_back(std::move(reply));
  }
  return replies;
}

}  // namespace

TEST_CASE("group generator: same seed and calls give the same groups") {
  for (auto mode : {GroupGenerationMode::kRandom, GroupGenerationMode::kSmart}) {
    for (bool inter_intra : {false, true}) {
      if (inter_intra && mode == GroupGenerationMode::kRandom) continue;
      GroupGeneratorOptions o = options(6, 3, mode, 11);
      if (inter_intra) {
        o.local_size = 3;
        o.inter_intra = true;
        o.slowdown_threshold = 3;
      }
      const auto a = script(o);
      CHECK(a == script(o));
      o.seed = 12;
      CHECK(a != script(o));
    }
  }
}

TEST_CASE("group generator: a rank waiting on a group whose initiator leaves draws its own") {
  GroupGeneratorEngine engine(random_mode(3, 3));
  const Group g1 = run_once(engine, 0);
  CHECK(engine.request(0).kind == ReplyKind::kWait);  // pending {0, 1, 2}, started by 0
  CHECK(run_once(engine, 1) == g1);
  CHECK(engine.request(1).kind == ReplyKind::kWait);  // in rank 0's pending group
  CHECK(engine.pending().size() == 1);
  engine.leave(0);
  CHECK(engine.poll(0).kind == ReplyKind::kDone);
  REQUIRE(engine.pending().size() == 1);
  CHECK(engine.pending()[0].ranks == Ranks{1, 2});  // rank 1's own draw (2 holds g1)
  CHECK(engine.poll(1).kind == ReplyKind::kWait);
  CHECK(run_once(engine, 2) == g1);
  const Group g2 = group_of(engine.poll(1));
  CHECK(g2.ranks == Ranks{1, 2});
  CHECK(g2.id == 2);
}

TEST_CASE("group generator: pinned groups for seed 42 (the draws are portable)") {
  // std::mt19937_64 is specified bit for bit and the engine draws with its own
  // uniform and shuffle, so these hold with any standard library.
  GroupGeneratorEngine s(smart(8, 3, 42));
  CHECK(group_of(s.request(0)) == Group{.id = 1, .ranks = {0, 5, 7}});
  CHECK(s.buffer(1) == std::vector<Group>{Group{.id = 2, .ranks = {1, 2, 4}}});
  CHECK(s.buffer(3) == std::vector<Group>{Group{.id = 3, .ranks = {3, 6}}});
  GroupGeneratorEngine r(random_mode(8, 3, 42));
  CHECK(group_of(r.request(0)) == Group{.id = 1, .ranks = {0, 4, 7}});
  CHECK(group_of(r.request(5)) == Group{.id = 2, .ranks = {1, 5, 6}});
  auto o = smart(8, 3, 42);
  o.local_size = 4;
  o.inter_intra = true;
  GroupGeneratorEngine ii(o);
  CHECK(group_of(ii.request(0)) == Group{.id = 2, .ranks = {0, 1, 3}});
  CHECK(ii.buffer(2) ==
        std::vector<Group>{Group{.id = 1, .ranks = {2, 4}}, Group{.id = 4, .ranks = {0, 1, 2, 3}}});
  CHECK(ii.buffer(5) == std::vector<Group>{Group{.id = 3, .ranks = {5, 6, 7}},
                                           Group{.id = 5, .ranks = {4, 5, 6, 7}}});
}
