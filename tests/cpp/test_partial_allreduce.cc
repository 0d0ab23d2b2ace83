// P-Reduce (Communicator::partial_allreduce), ranks as threads: results
// against a float64 reference of the members' inputs, agreement bit for bit,
// non-members untouched, concurrent disjoint groups, bytes moved, and the
// failures: disagreeing members, bad member lists.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/ops/low_precision_partial_allreduce.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

// Input of `rank` at element i: distinct per rank, not exactly representable.
double input_of(int rank, std::int64_t i) {
  return std::sin(0.37 * static_cast<double>(i) + 1.3 * rank) * (1.0 + rank);
}

// The group of `rank` in a partition of the world into `groups` groups,
// round-robin (groups of one included).
std::vector<int> group_of(int rank, int world, int groups) {
  std::vector<int> members;
  for (int r = 0; r < world; ++r) {
    if (r % groups == rank % groups) members.push_back(r);
  }
  return members;
}

template <typename T>
void check_group_result(const std::vector<std::vector<T>>& results, const std::vector<int>& group,
                        std::int64_t n, ReduceOp op) {
  const double m = static_cast<double>(group.size());
  for (std::int64_t i = 0; i < n; ++i) {
    double expect = op == ReduceOp::kMax ? -1e300 : 0.0, scale = 0.0;
    for (int r : group) {
      const double x = input_of(r, i);
      expect = op == ReduceOp::kMax ? std::max(expect, x) : expect + x;
      scale = std::max(scale, std::abs(x));
    }
    if (op == ReduceOp::kAvg) expect /= m;
    const double tolerance = (sizeof(T) == 4 ? 1e-6 : 1e-12) * (1 + scale) * m;
    const auto got = static_cast<double>(results[static_cast<std::size_t>(group[0])][i]);
    if (std::abs(got - expect) > tolerance) {
      FAIL("element ", i, " of group ", group[0], ": ", got, " vs ", expect);
    }
  }
  // Every member holds the same bits.
  for (int r : group) {
    const auto& mine = results[static_cast<std::size_t>(r)];
    const auto& first = results[static_cast<std::size_t>(group[0])];
    // (memcmp of an empty vector's null data is undefined, even for 0 bytes)
    CHECK((mine.empty() || std::memcmp(mine.data(), first.data(), mine.size() * sizeof(T)) == 0));
  }
}

// Each rank of `world` joins its group (`groups` disjoint groups, all at
// once) and P-Reduces n elements of T with `op`.
template <typename T>
void run_partition(int world, int groups, std::int64_t n, ReduceOp op, DType dtype) {
  std::vector<std::vector<T>> results(static_cast<std::size_t>(world));
  testing::run_ranks(world, [&](Communicator& comm) {
    const auto group = group_of(comm.rank(), world, groups);
    auto& data = results[static_cast<std::size_t>(comm.rank())];
    data.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(input_of(comm.rank(), i));
    const TensorView view{data.data(), n, dtype, {}};
    comm.partial_allreduce(view, view, group, op, 7, /*verify=*/true);
  });
  // The reference uses the float64 inputs; float's rounding of them is
  // within the tolerance.
  for (int g = 0; g < groups && g < world; ++g) {
    check_group_result(results, group_of(g, world, groups), n, op);
  }
}

}  // namespace

TEST_CASE("partial_allreduce: concurrent disjoint groups reach their means, bit-identical") {
  for (int world = 1; world <= 8; ++world) {
    for (int groups = 1; groups <= std::min(world, 3); ++groups) {
      for (std::int64_t n : {0, 1, 5, 1001, 65537}) {
        if (world > 6 && n != 1001 && n != 5) continue;  // keep the larger worlds short
        CAPTURE(world);
        CAPTURE(groups);
        CAPTURE(n);
        run_partition<float>(world, groups, n, ReduceOp::kAvg, DType::kFloat32);
        if (n == 1001) {
          run_partition<double>(world, groups, n, ReduceOp::kAvg, DType::kFloat64);
          run_partition<double>(world, groups, n, ReduceOp::kSum, DType::kFloat64);
          run_partition<float>(world, groups, n, ReduceOp::kMax, DType::kFloat32);
        }
      }
    }
  }
}

TEST_CASE("partial_allreduce: ranks outside the group are untouched and not involved") {
  // World 5: ranks 1 and 3 P-Reduce while 0, 2 and 4 do nothing at all.
  std::vector<std::vector<float>> results(5);
  testing::run_ranks(5, [&](Communicator& comm) {
    auto& data = results[static_cast<std::size_t>(comm.rank())];
    data.assign(300, static_cast<float>(comm.rank()));
    if (comm.rank() == 1 || comm.rank() == 3) {
      const int members[] = {1, 3};
      const TensorView view{data.data(), 300, DType::kFloat32, {}};
      comm.partial_allreduce(view, view, members, ReduceOp::kAvg, 0);
    }
  });
  for (int r : {0, 2, 4}) CHECK(results[static_cast<std::size_t>(r)][0] == static_cast<float>(r));
  CHECK(results[1][299] == 2.0f);
  CHECK(results[3][0] == 2.0f);
}

TEST_CASE(
    "partial_allreduce: the whole group equals allreduce, and bytes are 2(m-1)/m per member") {
  constexpr std::int64_t n = 30000;
  testing::run_ranks(4, [&](Communicator& comm) {
    std::vector<double> a(n), b(n);
    for (std::int64_t i = 0; i < n; ++i) a[i] = b[i] = input_of(comm.rank(), i);
    const int all[] = {0, 1, 2, 3};
    const auto sent_before = comm.counters().bytes_sent.load();
    comm.partial_allreduce(TensorView{a.data(), n, DType::kFloat64, {}},
                           TensorView{a.data(), n, DType::kFloat64, {}}, all, ReduceOp::kAvg, 1);
    const auto sent = comm.counters().bytes_sent.load() - sent_before;
    CHECK(sent == 2 * 3 * n * 8 / 4);
    comm.allreduce(TensorView{b.data(), n, DType::kFloat64, {}},
                   TensorView{b.data(), n, DType::kFloat64, {}}, ReduceOp::kAvg);
    for (std::int64_t i = 0; i < n; i += 97) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-12));
  });
}

TEST_CASE("partial_allreduce: up to 64 KiB per member, one step: (m-1) M bytes, bit-identical") {
  // Three members: 4096 doubles (2 x 32 KiB sent) go directly, one more
  // element takes the ring (2 (m-1)/m M); every member agrees either way.
  for (std::int64_t n : {1000, 4096, 4097}) {
    CAPTURE(n);
    std::vector<std::vector<double>> results(3);
    std::vector<std::int64_t> sent(3);
    testing::run_ranks(3, [&](Communicator& comm) {
      auto& data = results[static_cast<std::size_t>(comm.rank())];
      data.resize(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) data[i] = input_of(comm.rank(), i);
      const int all[] = {0, 1, 2};
      const TensorView view{data.data(), n, DType::kFloat64, {}};
      const auto before = comm.counters().bytes_sent.load();
      comm.partial_allreduce(view, view, all, ReduceOp::kAvg, 4);
      sent[static_cast<std::size_t>(comm.rank())] = comm.counters().bytes_sent.load() - before;
    });
    check_group_result(results, {0, 1, 2}, n, ReduceOp::kAvg);
    if (n <= 4096) {
      for (auto bytes : sent) CHECK(bytes == 2 * n * 8);  // (m - 1) M
    } else {
      CHECK(sent[0] + sent[1] + sent[2] == 2 * 2 * n * 8);  // 2 (m - 1) / m M, summed over m
    }
  }
}

TEST_CASE("partial_allreduce: overlapping groups called in the same order, many times") {
  // Ranks 0..3; rounds alternate the groups {0,1},{2,3} and {1,2},{0,3}:
  // a long chain of groups sharing members, every pair in the same order.
  std::vector<std::vector<double>> results(4);
  testing::run_ranks(4, [&](Communicator& comm) {
    auto& x = results[static_cast<std::size_t>(comm.rank())];
    x.assign(17, static_cast<double>(comm.rank()));
    for (int round = 0; round < 40; ++round) {
      const int r = comm.rank();
      std::vector<int> group = round % 2 == 0       ? std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}
                               : (r == 1 || r == 2) ? std::vector<int>{1, 2}
                                                    : std::vector<int>{0, 3};
      const std::uint64_t id = comm.next_partial_id(group);
      comm.partial_allreduce(TensorView{x.data(), 17, DType::kFloat64, {}},
                             TensorView{x.data(), 17, DType::kFloat64, {}}, group, ReduceOp::kAvg,
                             id);
    }
  });
  // Doubly stochastic steps conserve the sum; 40 of them reach consensus.
  double sum = 0;
  for (const auto& x : results) sum += x[0];
  CHECK(sum == doctest::Approx(6.0).epsilon(1e-12));
  for (const auto& x : results) CHECK(x[16] == doctest::Approx(1.5).epsilon(1e-9));
}

TEST_CASE("partial_allreduce: through the mailboxes and over the network, the same bits") {
  // World 5, 60 rounds of a random partition into groups of 1 to 3 (the
  // same draw on every rank), sizes that go directly (and, at 9000
  // doubles, the ring after a verified header): the ranks' results with
  // shared-memory mailboxes and without are equal bit for bit
  // (test_shared_memory_messages.cc checks that the mailboxes are taken).
  constexpr int kWorld = 5;
  const auto run = [&](bool shared) {
    GlooOptions options;
    options.timeout = std::chrono::seconds(20);
    options.shared_memory = SharedMemoryOptions{.enabled = shared};
    std::vector<std::vector<double>> results(kWorld);
    testing::run_ranks_with(kWorld, options, [&](Communicator& comm) {
      std::mt19937 draw(42);
      auto& x = results[static_cast<std::size_t>(comm.rank())];
      for (int round = 0; round < 60; ++round) {
        const std::int64_t n = std::array<std::int64_t, 4>{3, 500, 2731, 9000}[round % 4];
        x.resize(static_cast<std::size_t>(n));
        for (std::int64_t i = 0; i < n; ++i) x[i] = input_of(comm.rank(), i + round);
        std::vector<int> order(kWorld);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), draw);
        const std::size_t cut = 1 + draw() % 3;  // the first group's size, the rest in 3s
        std::vector<int> group;
        for (std::size_t start = 0; start < order.size();) {
          const std::size_t end = std::min(order.size(), start == 0 ? cut : start + 3);
          std::vector<int> g(order.begin() + static_cast<long>(start),
                             order.begin() + static_cast<long>(end));
          if (std::find(g.begin(), g.end(), comm.rank()) != g.end()) group = g;
          start = end;
        }
        std::sort(group.begin(), group.end());
        const TensorView view{x.data(), n, DType::kFloat64, {}};
        comm.partial_allreduce(view, view, group, ReduceOp::kAvg, static_cast<std::uint64_t>(round),
                               /*verify=*/round % 2 == 0);
      }
    });
    return results;
  };
  const auto through_mailboxes = run(true), over_network = run(false);
  for (int r = 0; r < kWorld; ++r) {
    CAPTURE(r);
    const auto& a = through_mailboxes[static_cast<std::size_t>(r)];
    const auto& b = over_network[static_cast<std::size_t>(r)];
    REQUIRE(a.size() == b.size());
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("partial_allreduce: members that disagree fail with the group named, never mixed data") {
  SUBCASE("different group ids: a timeout (or the peer's closing) naming the group on both") {
    auto errors = testing::run_ranks_collect_errors(
        2,
        [&](Communicator& comm) {
          std::vector<float> x(100, static_cast<float>(comm.rank()));
          const int members[] = {0, 1};
          const TensorView view{x.data(), 100, DType::kFloat32, {}};
          comm.partial_allreduce(view, view, members, ReduceOp::kAvg, comm.rank() == 0 ? 5 : 6);
        },
        std::chrono::milliseconds(500));
    for (const auto& message : errors) {
      CAPTURE(message);
      CHECK(message.find("partial_allreduce of group") != std::string::npos);
      CHECK(message.find("ranks 0,1") != std::string::npos);
      // The first to time out closes its connections: the other may see that first.
      CHECK((message.find("timed out") != std::string::npos ||
             message.find("closed") != std::string::npos));
    }
  }
  SUBCASE("different sizes with verify: InvalidArgument on every member") {
    auto errors = testing::run_ranks_collect_errors(3, [&](Communicator& comm) {
      std::vector<float> x(comm.rank() == 2 ? 9 : 8);
      const int members[] = {0, 1, 2};
      const TensorView view{x.data(), static_cast<std::int64_t>(x.size()), DType::kFloat32, {}};
      comm.partial_allreduce(view, view, members, ReduceOp::kSum, 3, /*verify=*/true);
    });
    for (const auto& message : errors) {
      CAPTURE(message);
      CHECK(message.find("different calls") != std::string::npos);
    }
    CHECK(errors[0].find("rank 2 passed float32[9]") != std::string::npos);
  }
  SUBCASE("one member's tensor takes the ring, the others' go directly: InvalidArgument") {
    auto errors = testing::run_ranks_collect_errors(3, [&](Communicator& comm) {
      std::vector<float> x(comm.rank() == 1 ? 100000 : 8);
      const int members[] = {0, 1, 2};
      const TensorView view{x.data(), static_cast<std::int64_t>(x.size()), DType::kFloat32, {}};
      comm.partial_allreduce(view, view, members, ReduceOp::kAvg, 3, /*verify=*/true);
    });
    for (const auto& message : errors) {
      CAPTURE(message);
      CHECK(message.find("different calls") != std::string::npos);
    }
    CHECK(errors[0].find("rank 1 passed float32[100000]") != std::string::npos);
  }
}

TEST_CASE("partial_allreduce: bad member lists are InvalidArgument before any communication") {
  testing::run_ranks(3, [&](Communicator& comm) {
    std::vector<float> x(4), y(5);
    const TensorView vx{x.data(), 4, DType::kFloat32, {}};
    const TensorView vy{y.data(), 5, DType::kFloat32, {}};
    const std::vector<int> others = comm.rank() == 0 ? std::vector<int>{1, 2} : std::vector<int>{0};
    const std::vector<int> unsorted{2, 1, 0}, duplicate{0, 0, 1, 2}, outside{0, 1, 2, 3};
    const std::vector<int> empty;
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vx, others, ReduceOp::kSum, 0), InvalidArgument);
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vx, unsorted, ReduceOp::kSum, 0), InvalidArgument);
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vx, duplicate, ReduceOp::kSum, 0), InvalidArgument);
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vx, outside, ReduceOp::kSum, 0), InvalidArgument);
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vx, empty, ReduceOp::kSum, 0), InvalidArgument);
    CHECK_THROWS_AS(comm.partial_allreduce(vx, vy, std::vector<int>{0, 1, 2}, ReduceOp::kSum, 0),
                    InvalidArgument);
  });
}

TEST_CASE("low-precision partial_allreduce: members agree bit for bit, within the 8-bit error") {
  for (int world : {2, 3, 5}) {
    for (std::int64_t n : {1, 7, 1000, 30001}) {
      CAPTURE(world);
      CAPTURE(n);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(world));
      testing::run_ranks(world, [&](Communicator& comm) {
        // Two groups: the even ranks and the odd ones.
        std::vector<int> group;
        for (int r = comm.rank() % 2; r < world; r += 2) group.push_back(r);
        auto& x = results[static_cast<std::size_t>(comm.rank())];
        x.resize(static_cast<std::size_t>(n));
        for (std::int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(input_of(comm.rank(), i));
        const auto sent = comm.counters().bytes_sent.load();
        low_precision_partial_allreduce(comm, TensorView{x.data(), n, DType::kFloat32, {}}, group,
                                        9);
        // About a quarter of the full precision ring's 2 (m - 1) / m * 4n bytes.
        const auto m = static_cast<std::int64_t>(group.size());
        if (m > 1 && n >= 1000) {
          CHECK(comm.counters().bytes_sent.load() - sent <= 2 * (m - 1) * (n / m + 1 + 8));
        }
      });
      for (int parity = 0; parity < std::min(world, 2); ++parity) {
        std::vector<int> group;
        for (int r = parity; r < world; r += 2) group.push_back(r);
        for (int r : group) {
          CHECK(std::memcmp(results[static_cast<std::size_t>(r)].data(),
                            results[static_cast<std::size_t>(group[0])].data(),
                            static_cast<std::size_t>(n) * sizeof(float)) == 0);
        }
        // Each input is within (max - min) / 510 of its decoded value; the
        // average, compressed again, adds as much: (1 + 3) / 255 of the range.
        for (std::int64_t i = 0; i < n; ++i) {
          double mean = 0;
          for (int r : group) mean += input_of(r, i);
          mean /= static_cast<double>(group.size());
          const double range = 2.0 * (1.0 + world);
          if (std::abs(results[static_cast<std::size_t>(group[0])][i] - mean) > 2 * range / 255) {
            FAIL("element ", i, ": ", results[static_cast<std::size_t>(group[0])][i], " vs ", mean);
          }
        }
      }
    }
  }
}

// Tensors of scales 1e-3, 1 and 1e3 back to back: coded with one min/max per
// chunk, the small one is lost in the large one's range; coded per piece,
// each element is within its own tensor's 8-bit error.
TEST_CASE("low-precision partial_allreduce: a code layout keeps each tensor's own range") {
  const std::vector<std::int64_t> segments{700, 3000, 1301};  // 5001 elements
  const std::array<double, 3> scales{1e-3, 1.0, 1e3};
  const auto value = [&](int rank, std::int64_t i) {
    std::int64_t start = 0;
    std::size_t s = 0;
    while (i >= start + segments[s]) start += segments[s++];
    return std::pair{static_cast<float>(scales[s] * input_of(rank, i)), s};
  };
  for (int world : {3, 5}) {
    for (const std::int64_t piece : {std::int64_t{1024}, std::int64_t{100000}}) {
      CAPTURE(world);
      CAPTURE(piece);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(world));
      testing::run_ranks(world, [&](Communicator& comm) {
        std::vector<int> everyone(static_cast<std::size_t>(world));
        std::iota(everyone.begin(), everyone.end(), 0);
        auto& x = results[static_cast<std::size_t>(comm.rank())];
        x.resize(5001);
        for (std::int64_t i = 0; i < 5001; ++i) x[i] = value(comm.rank(), i).first;
        low_precision_partial_allreduce(comm, TensorView{x.data(), 5001, DType::kFloat32, {}},
                                        everyone, 4, CodeLayout{segments, piece});
      });
      for (int r = 1; r < world; ++r) {
        CHECK(std::memcmp(results[static_cast<std::size_t>(r)].data(), results[0].data(),
                          5001 * sizeof(float)) == 0);
      }
      for (std::int64_t i = 0; i < 5001; ++i) {
        double mean = 0;
        for (int r = 0; r < world; ++r) mean += value(r, i).first;
        mean /= world;
        const double range = 2.0 * (1.0 + world) * scales[value(0, i).second];
        if (std::abs(results[0][i] - mean) > 2 * range / 255 + 1e-6 * std::abs(mean)) {
          FAIL("element ", i, ": ", results[0][i], " vs ", mean);
        }
      }
      // A min/max more per piece than per chunk: 8 bytes each.
      const auto expected = low_precision_coded_bytes(5001, world, CodeLayout{segments, piece});
      CHECK(expected > low_precision_coded_bytes(5001, world));
      CHECK(expected == 5001 + 8 * (piece == 1024 ? 1 + 3 + 2 + (world - 1) : 3 + (world - 1)));
    }
  }
}

TEST_CASE("low-precision partial_allreduce: a layout that does not fit the buffer is refused") {
  testing::run_ranks(2, [&](Communicator& comm) {
    std::vector<float> x(10);
    const TensorView view{x.data(), 10, DType::kFloat32, {}};
    const std::vector<int> both{0, 1};
    const std::vector<std::int64_t> short_segments{4, 5}, negative{11, -1}, fitting{4, 6};
    CHECK_THROWS_AS(low_precision_partial_allreduce(comm, view, both, 1, {short_segments, 4}),
                    InvalidArgument);
    CHECK_THROWS_AS(low_precision_partial_allreduce(comm, view, both, 1, {negative, 4}),
                    InvalidArgument);
    CHECK_THROWS_AS(low_precision_partial_allreduce(comm, view, both, 1, {fitting, 0}),
                    InvalidArgument);
  });
}
