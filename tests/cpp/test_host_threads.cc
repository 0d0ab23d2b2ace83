// for_each_range (bagua/core/host_threads.h): every index once, on several
// threads when asked, failures rethrown, nested and concurrent calls run to
// the end.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bagua/core/errors.h"
#include "bagua/core/host_threads.h"

using namespace bagua;

namespace {

// Restores the thread count a test changed.
struct ThreadsSetting {
  int before = host_threads();
  explicit ThreadsSetting(int threads) { set_host_threads(threads); }
  ~ThreadsSetting() { set_host_threads(before); }
  ThreadsSetting(const ThreadsSetting&) = delete;
  ThreadsSetting& operator=(const ThreadsSetting&) = delete;
};

// How many times each index of [0, n) was visited by one call.
std::vector<int> visits(std::int64_t n, std::int64_t grain) {
  std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
  for_each_range(n, grain, [&](std::int64_t begin, std::int64_t end) {
    REQUIRE(0 <= begin);
    REQUIRE(begin < end);
    REQUIRE(end <= n);
    for (std::int64_t i = begin; i < end; ++i) seen[static_cast<std::size_t>(i)]++;
  });
  std::vector<int> counts(seen.size());
  for (std::size_t i = 0; i < seen.size(); ++i) counts[i] = seen[i].load();
  return counts;
}

}  // namespace

TEST_CASE("for_each_range visits every index once, whatever the threads and the grain") {
  for (const int threads : {1, 2, 3, 5, 8}) {
    ThreadsSetting setting(threads);
    for (const std::int64_t n : {0, 1, 2, 7, 64, 1000, 4099}) {
      for (const std::int64_t grain : {0, 1, 3, 100, 5000}) {
        CAPTURE(threads);
        CAPTURE(n);
        CAPTURE(grain);
        CHECK(visits(n, grain) == std::vector<int>(static_cast<std::size_t>(n), 1));
      }
    }
  }
}

TEST_CASE("for_each_range runs the ranges on several threads when asked") {
  const auto threads_used = [](std::int64_t parts) {
    std::mutex mutex;
    std::set<std::thread::id> ids;
    for_each_range(parts, 1, [&](std::int64_t, std::int64_t) {
      {
        std::lock_guard lock(mutex);
        ids.insert(std::this_thread::get_id());
      }
      // Long enough for a woken worker to claim a range on a loaded machine.
      std::this_thread::sleep_for(std::chrono::milliseconds(60));
    });
    return ids.size();
  };
  {
    ThreadsSetting setting(1);
    const std::int64_t cut = host_ranges_cut();
    CHECK(threads_used(4) == 1);
    CHECK(host_ranges_cut() == cut);
  }
  ThreadsSetting setting(4);
  const std::int64_t cut = host_ranges_cut();
  std::size_t most = 0;
  for (int attempt = 0; attempt < 5 && most < 2; ++attempt) most = std::max(most, threads_used(4));
  CHECK(most >= 2);
  CHECK(most <= 4);
  CHECK(host_ranges_cut() > cut);
}

TEST_CASE("a range's failure is rethrown once every range has ended") {
  ThreadsSetting setting(3);
  std::atomic<std::int64_t> ended{0};  // items of the ranges that ended
  const auto fail_at_2 = [&](std::int64_t begin, std::int64_t end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ended += end - begin;
    if (begin <= 2 && 2 < end) throw std::runtime_error("the range of item 2 failed");
  };
  CHECK_THROWS_WITH_AS(for_each_range(6, 1, fail_at_2), "the range of item 2 failed",
                       std::runtime_error);
  CHECK(ended.load() == 6);
  CHECK(visits(100, 1) == std::vector<int>(100, 1));  // the pool still works
}

TEST_CASE("nested and concurrent calls of for_each_range run to the end") {
  ThreadsSetting setting(3);
  std::atomic<std::int64_t> inner{0};
  for_each_range(6, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      for_each_range(10, 1, [&](std::int64_t first, std::int64_t last) { inner += last - first; });
    }
  });
  CHECK(inner.load() == 60);

  std::vector<std::vector<int>> results(4);
  std::vector<std::thread> callers;
  for (std::size_t t = 0; t < results.size(); ++t) {
    callers.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) results[t] = visits(3000, 7);
    });
  }
  for (auto& c : callers) c.join();
  for (const auto& r : results) CHECK(r == std::vector<int>(3000, 1));
}

TEST_CASE("set_host_threads refuses counts outside 1 to 256") {
  const int before = host_threads();
  CHECK_THROWS_AS(set_host_threads(0), InvalidArgument);
  CHECK_THROWS_AS(set_host_threads(257), InvalidArgument);
  CHECK(host_threads() == before);
}
