// Lib-internal: the control block of a shared-memory group (its counters in
// the segment) and the waits on it, shared by shared_memory.cc (the segment,
// the slot protocol, allgather / broadcast / alltoall) and
// shared_memory_direct.cc (the direct allreduce through the peers' memory).
// See bagua/comm/shared_memory.h.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/shared_memory.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace shm {

inline constexpr std::size_t kLine = 64;  // one cache line per rank's counters
inline constexpr std::size_t kPage = 4096;
inline constexpr std::chrono::milliseconds kSlice{100};  // how often a waiter checks its peers

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

inline std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

inline long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value,
                  const timespec* timeout) {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, timeout, nullptr,
                   0);
}

// Lets a waiting core breathe without giving it up.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Whether process `pid` has ended: gone, or a zombie its parent has not
// reaped yet (a killed rank stays one until its launcher waits for it).
inline bool process_exited(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string stat = read_first_line(fmt::format("/proc/{}/stat", pid).c_str());
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return stat.empty();
  const char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

enum class Stage { kWritten, kReduced, kConsumed };

struct alignas(kLine) RankState {
  std::atomic<std::uint64_t> written{0};
  std::atomic<std::uint64_t> reduced{0};
  std::atomic<std::uint64_t> consumed{0};
  std::atomic<std::int32_t> pid{0};
  // The buffer of this rank's direct allreduce in flight (valid once
  // written = that call).
  std::atomic<std::uint64_t> address{0};

  std::atomic<std::uint64_t>& at(Stage stage) {
    return stage == Stage::kWritten ? written : stage == Stage::kReduced ? reduced : consumed;
  }
};

}  // namespace shm

// Header lines (the futex word and its waiter count; the direct allreduce's
// block counters), then one line per rank.
struct SharedMemoryGroup::Control {
  alignas(shm::kLine) std::atomic<std::uint32_t> epoch{0};
  std::atomic<std::uint32_t> waiters{0};
  // Blocks of direct allreduces claimed and finished so far, over all calls
  // (each call's blocks are numbered on from the previous call's).
  alignas(shm::kLine) std::atomic<std::uint64_t> claimed{0};
  std::atomic<std::uint64_t> finished{0};

  shm::RankState& rank(int r) {
    return *reinterpret_cast<shm::RankState*>(reinterpret_cast<std::byte*>(this) + sizeof(Control) +
                                              static_cast<std::size_t>(r) * sizeof(shm::RankState));
  }
  static std::size_t bytes(int size) {
    return shm::round_up(sizeof(Control) + static_cast<std::size_t>(size) * sizeof(shm::RankState),
                         shm::kPage);
  }

  // Wakes whoever waits, after a counter changed.
  void wake() {
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (waiters.load(std::memory_order_seq_cst) > 0)
      shm::futex(&epoch, FUTEX_WAKE, INT_MAX, nullptr);
  }

  // Makes this rank's `stage` counter `value` and wakes whoever waits.
  void publish(int r, shm::Stage stage, std::uint64_t value) {
    rank(r).at(stage).store(value, std::memory_order_release);
    wake();
  }
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free &&
                  std::atomic<std::uint32_t>::is_always_lock_free,
              "counters in shared memory must be lock-free atomics");

// Waits of one allreduce call: until every rank's counter of a stage reached
// a value, bounded by the timeout, watching for an abort and dead peers.
class SharedMemoryGroup::Waiter {
 public:
  Waiter(SharedMemoryGroup& owner, const char* op, const TensorView& buffer,
         std::chrono::milliseconds timeout, const std::atomic<bool>& aborted)
      : owner_(owner),
        op_(op),
        buffer_(buffer),
        timeout_(timeout),
        aborted_(aborted),
        spin_(static_cast<unsigned>(owner.size_) <= std::thread::hardware_concurrency()) {}

  void wait_all(shm::Stage stage, std::uint64_t target) {
    wait_until([&] { return all_reached(stage, target); },
               [&](auto deadline) { check_progress(stage, target, deadline); });
  }

  // Until `target` direct blocks are finished (by whichever ranks).
  void wait_blocks(std::uint64_t target) {
    std::atomic<std::uint64_t>& finished = owner_.control_->finished;
    wait_until([&] { return finished.load(std::memory_order_acquire) >= target; },
               [&](auto deadline) { check_blocks(finished.load(), target, deadline); });
  }

 private:
  template <typename Done, typename Check>
  void wait_until(Done&& done, Check&& check) {
    Control& c = *owner_.control_;
    if (spin_) {  // peers on cores of their own usually arrive within microseconds
      for (int i = 0; i < 256; ++i) {
        if (done()) return;
        shm::cpu_relax();
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      const std::uint32_t seen = c.epoch.load(std::memory_order_seq_cst);
      if (done()) return;
      check(deadline);
      const auto left = std::min<std::chrono::nanoseconds>(
          shm::kSlice, deadline - std::chrono::steady_clock::now());
      const timespec slice{0, std::max<long>(1000, static_cast<long>(left.count()))};
      c.waiters.fetch_add(1, std::memory_order_seq_cst);
      shm::futex(&c.epoch, FUTEX_WAIT, seen, &slice);
      c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // As check_progress, for blocks some rank claimed but has not finished.
  void check_blocks(std::uint64_t finished, std::uint64_t target,
                    std::chrono::steady_clock::time_point deadline) const {
    const auto where = [&] {
      return fmt::format(
          "direct allreduce of {} on rank {} of {} (group '{}'): {} blocks unfinished",
          buffer_.describe(), owner_.rank_, owner_.size_, owner_.group_name_,
          target - std::min(finished, target));
    };
    if (aborted_.load()) throw BackendError(where() + ": the communicator was aborted");
    for (int r = 0; r < owner_.size_; ++r) {
      const int pid = owner_.control_->rank(r).pid.load();
      if (r != owner_.rank_ && pid > 0 && shm::process_exited(pid)) {
        throw BackendError(fmt::format("{}: rank {} (pid {}) has exited", where(), r, pid));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{}: timed out after {} ms", where(), timeout_.count()));
    }
  }

  bool all_reached(shm::Stage stage, std::uint64_t target) const {
    for (int r = 0; r < owner_.size_; ++r) {
      if (owner_.control_->rank(r).at(stage).load(std::memory_order_acquire) < target) return false;
    }
    return true;
  }

  std::vector<int> missing(shm::Stage stage, std::uint64_t target) const {
    std::vector<int> ranks;
    for (int r = 0; r < owner_.size_; ++r) {
      if (owner_.control_->rank(r).at(stage).load(std::memory_order_acquire) < target) {
        ranks.push_back(r);
      }
    }
    return ranks;
  }

  // Throws when the wait cannot succeed: aborted, a missing peer's process
  // has exited, or the deadline passed.
  void check_progress(shm::Stage stage, std::uint64_t target,
                      std::chrono::steady_clock::time_point deadline) const {
    if (aborted_.load())
      throw BackendError(where(stage, target) + ": the communicator was aborted");
    for (const int r : missing(stage, target)) {
      const int pid = owner_.control_->rank(r).pid.load();
      if (pid > 0 && shm::process_exited(pid)) {
        throw BackendError(
            fmt::format("{}: rank {} (pid {}) has exited", where(stage, target), r, pid));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{}: timed out after {} ms waiting for ranks {}",
                                     where(stage, target), timeout_.count(),
                                     fmt::join(missing(stage, target), ", ")));
    }
  }

  std::string where(shm::Stage stage, std::uint64_t target) const {
    static constexpr const char* kStage[] = {"copy in", "reduce", "copy out"};
    return fmt::format(
        "allreduce of {} on rank {} of {} (shared memory, group '{}', {} of piece {})",
        buffer_.describe(), owner_.rank_, owner_.size_, owner_.group_name_,
        kStage[static_cast<int>(stage)], target);
  }

  SharedMemoryGroup& owner_;
  const char* op_;
  TensorView buffer_;
  std::chrono::milliseconds timeout_;
  const std::atomic<bool>& aborted_;
  bool spin_;
};

}  // namespace bagua
