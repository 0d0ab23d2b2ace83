// The group generator service with ranks as threads: every rank requests
// groups, P-Reduces a vector within each, stops after its own number of
// requests and drains. Checks the invariants of design/ripples.md 5.7 that
// the service is responsible for: every group completes (I4), the logs agree
// (I3: each id in exactly its members' histories, increasing per rank), no
// rank in two groups at once (I0), the sum over ranks conserved.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include "bagua/comm/communicator.h"
#include "bagua/runtime/group_generator_service.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

struct RankLog {
  std::vector<ExecutedGroup> history;
  std::vector<double> value;
};

// Odd ranks take longer between requests.
std::chrono::microseconds uneven_pace(int rank) {
  return std::chrono::microseconds(rank % 2 == 1 ? 300 : 0);
}

enum class Stop { kLeave, kLinger };

// Each rank takes `requests_of(rank)` groups, pausing `pause_of(rank)` after
// each, then leaves (or lingers) and drains.
std::vector<RankLog> run_service(
    int world, GroupGeneratorOptions options, const std::function<int(int)>& requests_of,
    std::chrono::milliseconds host_pause = {}, Stop stop = Stop::kLeave,
    const std::function<std::chrono::microseconds(int)>& pause_of = uneven_pace) {
  std::vector<RankLog> logs(static_cast<std::size_t>(world));
  options.world_size = world;
  testing::run_ranks(
      world,
      [&](Communicator& comm) {
        GroupGeneratorService service(comm, options);
        auto& log = logs[static_cast<std::size_t>(comm.rank())];
        log.value.assign(33, static_cast<double>(comm.rank() * comm.rank()));
        const TensorView view{log.value.data(), 33, DType::kFloat64, {}};
        auto run = [&](const Group& group) {
          comm.partial_allreduce(view, view, group.ranks, ReduceOp::kAvg, group.id, true);
          service.complete(group.id);
        };
        for (int i = 0; i < requests_of(comm.rank()); ++i) {
          auto group = service.acquire();
          REQUIRE(group.has_value());
          run(*group);
          std::this_thread::sleep_for(pause_of(comm.rank()));
        }
        if (stop == Stop::kLinger) {
          service.linger();
        } else {
          service.leave();
        }
        while (auto group = service.acquire()) run(*group);
        if (service.is_host()) std::this_thread::sleep_for(host_pause);
        service.close();
        log.history = service.history();
      },
      std::chrono::seconds(30));
  return logs;
}

void check_invariants(const std::vector<RankLog>& logs) {
  std::map<std::uint64_t, std::vector<int>> seen;  // id -> ranks that executed it
  std::map<std::uint64_t, std::vector<int>> members;
  double sum = 0, expected = 0;
  for (std::size_t r = 0; r < logs.size(); ++r) {
    const auto& history = logs[r].history;
    for (std::size_t i = 0; i < history.size(); ++i) {
      const auto& g = history[i];
      seen[g.group.id].push_back(static_cast<int>(r));
      if (members.count(g.group.id) != 0) CHECK(members[g.group.id] == g.group.ranks);
      members[g.group.id] = g.group.ranks;
      CHECK(std::count(g.group.ranks.begin(), g.group.ranks.end(), static_cast<int>(r)) == 1);
      CHECK(g.t_end >= g.t_start);
      if (i > 0) {
        CHECK(g.group.id > history[i - 1].group.id);  // increasing ids
        CHECK(g.t_start >= history[i - 1].t_end);     // one group at a time
      }
    }
    sum += logs[r].value[0];
    expected += static_cast<double>(r * r);
  }
  // Every group was executed by exactly its members: none lost or stranded.
  for (const auto& [id, ranks] : seen) {
    CAPTURE(id);
    CHECK(ranks == members[id]);
  }
  CHECK(sum == doctest::Approx(expected).epsilon(1e-12));
}

}  // namespace

TEST_CASE("group generator service: smart and random groups complete, logs agree, sum conserved") {
  for (auto mode : {GroupGenerationMode::kSmart, GroupGenerationMode::kRandom}) {
    for (int world : {1, 2, 3, 5}) {
      CAPTURE(to_string(mode));
      CAPTURE(world);
      GroupGeneratorOptions options;
      options.mode = mode;
      options.group_size = 3;
      options.seed = 11;
      // Ranks stop at different request counts.
      const auto logs = run_service(world, options, [](int rank) { return 20 + 7 * rank; });
      check_invariants(logs);
      for (int r = 0; r < world; ++r) {
        CHECK(logs[static_cast<std::size_t>(r)].history.size() >=
              static_cast<std::size_t>(20 + 7 * r));
      }
    }
  }
}

TEST_CASE("group generator service: smart inter-intra with a slowdown threshold on 2 nodes") {
  GroupGeneratorOptions options;
  options.group_size = 2;
  options.local_size = 2;
  options.inter_intra = true;
  options.slowdown_threshold = 3;
  const auto logs = run_service(4, options, [](int rank) { return rank == 3 ? 10 : 30; });
  check_invariants(logs);
}

TEST_CASE("group generator service: misuse is InvalidArgument") {
  testing::run_ranks(2, [&](Communicator& comm) {
    GroupGeneratorOptions options;
    options.world_size = 2;
    GroupGeneratorService service(comm, options);
    CHECK_THROWS_AS(service.complete(5), InvalidArgument);  // nothing running
    CHECK_THROWS_AS(service.close(), InvalidArgument);      // not left
    auto group = service.acquire();
    REQUIRE(group.has_value());
    CHECK_THROWS_AS(service.acquire(), InvalidArgument);  // the group still runs
    const TensorView none{nullptr, 0, DType::kFloat32, {}};
    comm.partial_allreduce(none, none, group->ranks, ReduceOp::kSum, group->id);
    service.complete(group->id);
    service.leave();
    while (auto more = service.acquire()) service.complete(more->id);
    service.close();
  });
  testing::run_ranks(2, [&](Communicator& comm) {
    GroupGeneratorOptions options;
    options.world_size = 3;  // not the communicator's size
    CHECK_THROWS_AS(GroupGeneratorService(comm, options), InvalidArgument);
  });
}

TEST_CASE("group generator service: a client whose host is gone fails within its timeout, named") {
  auto errors = testing::run_ranks_collect_errors(
      2,
      [&](Communicator& comm) {
        GroupGeneratorOptions options;
        options.world_size = 2;
        options.mode = GroupGenerationMode::kRandom;
        GroupGeneratorService service(comm, options);
        if (comm.rank() == 0) return;  // the host quits: its destructor aborts the service
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        service.acquire();
      },
      std::chrono::milliseconds(1500));
  CHECK(errors[0].empty());
  CAPTURE(errors[1]);
  CHECK(errors[1].find("group generator on rank 1") != std::string::npos);
  CHECK(errors[1].find("host (rank 0)") != std::string::npos);
}

TEST_CASE("group generator service: the host closing last returns (the others closed first)") {
  for (int round = 0; round < 5; ++round) {
    GroupGeneratorOptions options;
    options.seed = static_cast<std::uint64_t>(round);
    const auto logs = run_service(
        3, options, [](int rank) { return rank == 0 ? 40 : 5; }, std::chrono::milliseconds(300));
    check_invariants(logs);
    CHECK(logs[0].history.size() >= 40);
  }
}

TEST_CASE("group generator service: ranks that stop first linger and average with the last one") {
  for (auto mode : {GroupGenerationMode::kSmart, GroupGenerationMode::kRandom}) {
    for (int world : {4}) {
      CAPTURE(to_string(mode));
      CAPTURE(world);
      GroupGeneratorOptions options;
      options.mode = mode;
      options.group_size = 3;
      const int last = world - 1;
      const auto requests_of = [last](int rank) { return rank == last ? 40 : 5; };
      const auto pause_of = [last](int rank) {
        return std::chrono::microseconds(rank == last ? 1000 : 0);
      };
      const auto solos_of_last = [last](const std::vector<RankLog>& logs) {
        const auto& history = logs[static_cast<std::size_t>(last)].history;
        return std::count_if(history.begin(), history.end(),
                             [](const ExecutedGroup& g) { return g.group.ranks.size() == 1; });
      };
      const auto lingered = run_service(world, options, requests_of, {}, Stop::kLinger, pause_of);
      check_invariants(lingered);
      CHECK(solos_of_last(lingered) <= 5);
      for (int r = 0; r < last; ++r) {  // chosen after they stopped
        CHECK(lingered[static_cast<std::size_t>(r)].history.size() > 10);
      }
      // Leaving instead: the last rank trains its last steps alone.
      const auto left = run_service(world, options, requests_of, {}, Stop::kLeave, pause_of);
      check_invariants(left);
      CHECK(solos_of_last(left) >= 20);
    }
  }
}

TEST_CASE(
    "group generator service: a lingering rank nobody chooses leaves after half the timeout") {
  const auto timeout = std::chrono::milliseconds(1000);
  std::vector<double> lingered_s(3, 0.0);
  testing::run_ranks(
      3,
      [&](Communicator& comm) {
        GroupGeneratorOptions options;
        options.world_size = 3;
        GroupGeneratorService service(comm, options);
        if (comm.rank() == 2) {
          std::this_thread::sleep_for(2 * timeout);  // "evaluating": requests nothing
          auto group = service.acquire();
          REQUIRE(group.has_value());
          CHECK(group->ranks == std::vector<int>{2});  // the others left meanwhile
          service.complete(group->id);
          service.leave();
        } else {
          const auto start = std::chrono::steady_clock::now();
          service.linger();  // the host (rank 0) and a client (rank 1)
          CHECK(!service.acquire().has_value());
          lingered_s[static_cast<std::size_t>(comm.rank())] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
        while (auto group = service.acquire()) service.complete(group->id);
        service.close();
      },
      timeout);
  for (int r : {0, 1}) {
    CAPTURE(r);
    CHECK(lingered_s[static_cast<std::size_t>(r)] >= 0.45);
    CHECK(lingered_s[static_cast<std::size_t>(r)] < 0.95);
  }
}

TEST_CASE(
    "group generator service: a rank whose connection closes is named to every rank at once") {
  const auto timeout = std::chrono::milliseconds(5000);
  std::vector<double> seconds(3, 0.0);
  auto errors = testing::run_ranks_collect_errors(
      3,
      [&](Communicator& comm) {
        GroupGeneratorOptions options;
        options.world_size = 3;
        options.group_size = 2;
        auto service = std::make_unique<GroupGeneratorService>(comm, options);
        if (comm.rank() == 2) {
          REQUIRE(service->acquire().has_value());
          service.reset();  // "dies" holding its group: its connections close
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        const auto start = std::chrono::steady_clock::now();
        try {
          for (int i = 0; i < 1000; ++i) service->complete(service->acquire()->id);
        } catch (...) {
          seconds[static_cast<std::size_t>(comm.rank())] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          throw;
        }
      },
      timeout);
  CHECK(errors[2].empty());
  for (int r : {0, 1}) {
    CAPTURE(r);
    CAPTURE(errors[static_cast<std::size_t>(r)]);
    CHECK(errors[static_cast<std::size_t>(r)].find("rank 2 failed") != std::string::npos);
    CHECK(errors[static_cast<std::size_t>(r)].find("group") != std::string::npos);
    CHECK(seconds[static_cast<std::size_t>(r)] < 1.0);  // not the 5 s timeout
  }
  CHECK(errors[1].find("group generator on rank 1") != std::string::npos);
}

TEST_CASE("group generator service: every rank knows the longest group buffer") {
  std::vector<std::int64_t> longest(4, -1);
  testing::run_ranks(4, [&](Communicator& comm) {
    GroupGeneratorOptions options;
    options.world_size = 4;
    options.group_size = 2;
    options.inter_intra = true;
    options.local_size = 2;
    GroupGeneratorService service(comm, options);
    for (int i = 0; i < 6; ++i) service.complete(service.acquire()->id);
    longest[static_cast<std::size_t>(comm.rank())] = service.max_buffer_len();
    service.leave();
    while (auto group = service.acquire()) service.complete(group->id);
    service.close();
  });
  for (auto len : longest) CHECK(len == 2);  // inter_intra queues two groups per division
}
