// The neighbour ops behind bagua.bluefog (ops/neighbor_*.h), ranks as
// threads: uniform averaging exact, weights carried in the header, 16-bit
// floats accumulated once, pattern mismatches an InvalidArgument on every
// rank with the communicator still usable, allgather of differing sizes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "bagua/core/half.h"
#include "bagua/ops/neighbor_allgather.h"
#include "bagua/ops/neighbor_allreduce.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

std::shared_ptr<Communicator> all_ranks(Communicator& comm) {
  std::vector<int> ranks(static_cast<std::size_t>(comm.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return comm.new_group(ranks);
}

template <typename T>
TensorView view_of(std::vector<T>& v, DType dtype) {
  return TensorView{v.data(), static_cast<std::int64_t>(v.size()), dtype, {}};
}

// The ring neighbours of `rank`, each once, self excluded.
std::vector<int> ring(int rank, int n) {
  std::set<int> s{(rank + n - 1) % n, (rank + 1) % n};
  s.erase(rank);
  return {s.begin(), s.end()};
}

std::vector<NeighborWeight> ones(const std::vector<int>& ranks) {
  std::vector<NeighborWeight> out;
  for (int r : ranks) out.push_back({r, 1.0});
  return out;
}

// Options of a call (set member by member: designated initializers that
// leave members at their defaults draw -Wmissing-field-initializers).
NeighborAllreduceOptions options(std::optional<double> self_weight,
                                 std::vector<NeighborWeight> sources,
                                 std::vector<NeighborWeight> destinations,
                                 std::vector<int> ignored = {}) {
  NeighborAllreduceOptions o;
  o.self_weight = self_weight;
  o.sources = std::move(sources);
  o.destinations = std::move(destinations);
  o.ignored_sources = std::move(ignored);
  return o;
}

NeighborAllgatherOptions gather_options(std::vector<int> sources, std::vector<int> destinations) {
  NeighborAllgatherOptions o;
  o.sources = std::move(sources);
  o.destinations = std::move(destinations);
  return o;
}

}  // namespace

TEST_CASE("neighbor_allreduce: the uniform ring average, exact for equal values") {
  for (int n = 1; n <= 5; ++n) {
    bagua::testing::run_ranks(n, [&](Communicator& world) {
      NeighborAllreduce op(all_ranks(world));
      const int r = world.rank();
      const auto peers = ring(r, n);
      const auto o = options(std::nullopt, ones(peers), ones(peers));
      std::vector<double> x(7, r), out(7, -1);
      op.run(view_of(x, DType::kFloat64), view_of(out, DType::kFloat64), o);
      double expected = r;
      for (int p : peers) expected += p;
      expected /= static_cast<double>(peers.size() + 1);
      for (double v : out) CHECK(v == expected);
      // Multiplying by 1/(k+1) before summing would round 2^-256 * 3 / 3.
      std::vector<double> tiny(3, std::ldexp(1.0, -256)), tiny_out(3);
      op.run(view_of(tiny, DType::kFloat64), view_of(tiny_out, DType::kFloat64), o);
      for (double v : tiny_out) CHECK(v == std::ldexp(1.0, -256));
      CHECK(x[0] == r);  // the input is untouched
    });
  }
}

TEST_CASE("neighbor_allreduce: the receiver applies its source weight times the sender's") {
  const int n = 4;
  bagua::testing::run_ranks(n, [&](Communicator& world) {
    NeighborAllreduce op(all_ranks(world));
    const int r = world.rank();
    // Push-pull along the ring: self 0.5, source r-1 weight 1.0, sent with d = 0.25.
    const auto o = options(0.5, {{(r + n - 1) % n, 1.0}}, {{(r + 1) % n, 0.25}});
    std::vector<double> x(5, 8.0 * r), out(5);
    op.run(view_of(x, DType::kFloat64), view_of(out, DType::kFloat64), o);
    for (double v : out) CHECK(v == 0.5 * 8 * r + 0.25 * 8 * ((r + n - 1) % n));
    // A source received and ignored does not count.
    const auto partial = options(1.0, {}, {{(r + 1) % n, 1.0}}, {(r + n - 1) % n});
    op.run(view_of(x, DType::kFloat64), view_of(out, DType::kFloat64), partial);
    for (double v : out) CHECK(v == 8.0 * r);
  });
}

TEST_CASE("neighbor_allreduce: float16 is accumulated in float32 and rounded once") {
  const int n = 3;
  bagua::testing::run_ranks(n, [&](Communicator& world) {
    NeighborAllreduce op(all_ranks(world));
    const int r = world.rank();
    const auto peers = ring(r, n);
    // 2048 + 1 + 1: in float16 (spacing 2 above 2048) summing one at a time
    // would lose both ones; once in float32, (2048 + 2) / 3 rounds near 683.3.
    std::vector<Half> x(4, Half(r == 0 ? 2048.0f : 1.0f)), out(4);
    op.run(view_of(x, DType::kFloat16), view_of(out, DType::kFloat16),
           options(std::nullopt, ones(peers), ones(peers)));
    for (const Half& v : out) CHECK(std::fabs(static_cast<float>(v) - 2050.0f / 3) < 0.5f);
  });
}

TEST_CASE("neighbor_allreduce: a mismatched pattern fails on every rank, then the op works") {
  const int n = 3;
  const auto errors = bagua::testing::run_ranks_collect_errors(n, [&](Communicator& world) {
    NeighborAllreduce op(all_ranks(world));
    const int r = world.rank();
    std::vector<double> x(2, r), out(2);
    // Rank 0 sends to nobody; rank 1 still expects its message.
    auto bad = options(0.5, {{(r + n - 1) % n, 0.5}}, {});
    if (r != 0) bad.destinations = {{(r + 1) % n, 1.0}};
    CHECK_THROWS_AS(op.run(view_of(x, DType::kFloat64), view_of(out, DType::kFloat64), bad),
                    InvalidArgument);
    const auto peers = ring(r, n);
    op.run(view_of(x, DType::kFloat64), view_of(out, DType::kFloat64),
           options(std::nullopt, ones(peers), ones(peers)));
    CHECK(out[0] == 1.0);  // (0 + 1 + 2) / 3 everywhere
  });
  for (const auto& e : errors) CHECK(e.empty());
}

TEST_CASE("neighbor pattern check: every mismatch is named") {
  // Two ranks; rank 0 sends to 1, rank 1 receives from nobody; dtypes differ.
  const std::vector<std::int64_t> table = {7, 1, 4, 0, detail::kSends,  //
                                           7, 2, 4, 0, 0};
  const auto found = detail::pattern_mismatches(table, 2, 10);
  REQUIRE(found.size() == 2);
  CHECK(found[0] == "rank 1 passes another dtype than rank 0");
  CHECK(found[1] == "rank 0 sends to 1, which does not receive");
}

TEST_CASE("neighbor_allgather: sources' tensors of differing sizes, in the listed order") {
  for (int n = 1; n <= 4; ++n) {
    bagua::testing::run_ranks(n, [&](Communicator& world) {
      NeighborAllgather op(all_ranks(world));
      const int r = world.rank();
      std::vector<std::int64_t> mine(static_cast<std::size_t>(r + 1), r);
      auto peers = ring(r, n);
      std::reverse(peers.begin(), peers.end());  // any order
      const auto plan = op.plan(DType::kInt64, r + 1, gather_options(peers, peers));
      std::vector<std::int64_t> out(static_cast<std::size_t>(plan.total()), -1);
      op.run(plan, view_of(mine, DType::kInt64), view_of(out, DType::kInt64));
      std::vector<std::int64_t> expected;
      for (int p : peers) expected.insert(expected.end(), static_cast<std::size_t>(p + 1), p);
      CHECK(out == expected);
    });
  }
}
