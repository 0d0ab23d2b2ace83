// TaskThread: tasks run in submission order on another thread, a task's
// exception reaches wait(), a task still running past the timeout is a
// TimeoutError, and the destructor runs what was queued before it joins.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bagua/core/errors.h"
#include "bagua/core/task_thread.h"

using namespace bagua;
using namespace std::chrono_literals;

TEST_CASE("task thread: tasks run in order, on a thread of their own") {
  std::vector<int> order;
  std::thread::id where;
  {
    TaskThread tasks;
    std::int64_t last = -1;
    for (int i = 0; i < 100; ++i) {
      last = tasks.submit([&order, &where, i] {
        order.push_back(i);
        where = std::this_thread::get_id();
      });
    }
    tasks.wait(last, 10s, "test");
    CHECK(tasks.tasks_run() == 100);
  }
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  CHECK(where != std::this_thread::get_id());
}

TEST_CASE("task thread: a task's exception is rethrown by its wait only") {
  TaskThread tasks;
  const auto failing = tasks.submit([] { throw std::runtime_error("pass failed"); });
  const auto fine = tasks.submit([] {});
  CHECK_THROWS_WITH_AS(tasks.wait(failing, 10s, "test"), "pass failed", std::runtime_error);
  CHECK_NOTHROW(tasks.wait(fine, 10s, "test"));
}

TEST_CASE("task thread: a wait past its timeout names what it waited for") {
  std::atomic<bool> release{false};
  TaskThread tasks;
  const auto slow = tasks.submit([&] {
    while (!release.load()) std::this_thread::sleep_for(1ms);
  });
  CHECK_THROWS_AS(tasks.wait(slow, 20ms, "C_LP_S rank 3 segment 2 of 5"), TimeoutError);
  try {
    tasks.wait(slow, 1ms, "C_LP_S rank 3 segment 2 of 5");
  } catch (const TimeoutError& e) {
    CHECK(std::string(e.what()).find("C_LP_S rank 3 segment 2 of 5") != std::string::npos);
  }
  release = true;
  tasks.wait(slow, 10s, "test");
}

TEST_CASE("task thread: the destructor runs the queued tasks before it joins") {
  std::atomic<int> ran{0};
  {
    TaskThread tasks;
    tasks.submit([&] {
      std::this_thread::sleep_for(20ms);
      ++ran;
    });
    for (int i = 0; i < 10; ++i) tasks.submit([&] { ++ran; });
  }
  CHECK(ran.load() == 11);
}
