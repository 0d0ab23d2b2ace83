// The pool behind for_each_range (core/host_threads.h): workers started on
// the first call that needs them, woken for each call, the calling thread
// working beside them. One call at a time uses the pool; the ranges of a call
// are claimed from a counter, so a worker the scheduler leaves out is not
// waited for (the others, the caller included, take its ranges).
#include "bagua/core/host_threads.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {
namespace {

constexpr int kMostThreads = 256;

using RangeFn = std::function<void(std::int64_t, std::int64_t)>;

// One call of for_each_range: `parts` ranges of [0, n).
struct Region {
  const RangeFn* fn = nullptr;
  std::int64_t n = 0;
  std::int64_t parts = 0;
  std::atomic<std::int64_t> next{0};  // the next range to claim
  std::int64_t finished = 0;          // ranges done (under the pool's mutex)
  int helpers = 0;                    // workers inside the region (under the mutex)
  std::exception_ptr error;           // the first range's failure (under the mutex)
};

thread_local bool inside_range = false;  // nested calls run alone

class Pool {
 public:
  // Runs `region` on up to region.parts threads, this one included.
  void run(Region& region) {
    start_workers(static_cast<int>(region.parts) - 1);
    {
      std::lock_guard lock(mutex_);
      region_ = &region;
      ++generation_;
    }
    wake_.notify_all();
    work_on(region);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return region.finished == region.parts && region.helpers == 0; });
    region_ = nullptr;
  }

  std::mutex& call_mutex() { return call_mutex_; }

 private:
  void start_workers(int wanted) {
    std::lock_guard lock(mutex_);
    while (static_cast<int>(workers_.size()) < wanted) {
      workers_.emplace_back([this] { serve(); });
    }
  }

  void serve() {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      Region* region = region_;
      if (region == nullptr) continue;
      ++region->helpers;
      lock.unlock();
      work_on(*region);
      lock.lock();
      --region->helpers;
      done_.notify_all();
    }
  }

  void work_on(Region& region) {
    inside_range = true;
    for (;;) {
      const std::int64_t part = region.next.fetch_add(1);
      if (part >= region.parts) break;
      const std::int64_t begin = part * region.n / region.parts;
      const std::int64_t end = (part + 1) * region.n / region.parts;
      std::exception_ptr failure;
      try {
        (*region.fn)(begin, end);
      } catch (...) {
        failure = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      if (failure && !region.error) region.error = failure;
      if (++region.finished == region.parts) done_.notify_all();
    }
    inside_range = false;
  }

  std::mutex call_mutex_;  // one call of for_each_range at a time uses the pool
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  Region* region_ = nullptr;
  std::uint64_t generation_ = 0;
  // Never joined: the pool lives as long as the process (see pool()).
  std::vector<std::thread> workers_;
};

std::atomic<int> wanted_threads{1};
std::atomic<std::int64_t> calls_cut{0};
std::atomic<Pool*> current_pool{nullptr};

// The process's pool. Never destroyed: workers blocked in wait at exit end
// with the process, and no destructor can run while a range still uses it.
// A forked child gets a new pool: the parent's workers do not exist there,
// and a mutex may have been held by one of them at the fork.
Pool& pool() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { current_pool.store(nullptr); });
    return true;
  }();
  (void)registered;
  Pool* p = current_pool.load();
  if (p == nullptr) {
    static std::mutex creating;
    std::lock_guard lock(creating);
    p = current_pool.load();
    if (p == nullptr) {
      p = new Pool();  // NOLINT(cppcoreguidelines-owning-memory): lives as long as the process
      current_pool.store(p);
    }
  }
  return *p;
}

}  // namespace

int host_threads() { return wanted_threads.load(std::memory_order_relaxed); }

void set_host_threads(int threads) {
  BAGUA_CHECK_ARG(threads >= 1 && threads <= kMostThreads,
                  "host threads must be between 1 and {}, got {}", kMostThreads, threads);
  wanted_threads.store(threads, std::memory_order_relaxed);
}

std::int64_t host_ranges_cut() { return calls_cut.load(std::memory_order_relaxed); }

void for_each_range(std::int64_t n, std::int64_t grain, const RangeFn& fn) {
  if (n <= 0) return;
  const std::int64_t parts = std::min<std::int64_t>(
      host_threads(), std::max<std::int64_t>(1, n / std::max<std::int64_t>(1, grain)));
  if (parts <= 1 || inside_range) {
    fn(0, n);
    return;
  }
  Pool& p = pool();
  std::unique_lock call(p.call_mutex(), std::try_to_lock);
  if (!call.owns_lock()) {  // another thread's call has the pool: no waiting for it
    fn(0, n);
    return;
  }
  calls_cut.fetch_add(1, std::memory_order_relaxed);
  Region region;
  region.fn = &fn;
  region.n = n;
  region.parts = parts;
  p.run(region);
  if (region.error) std::rethrow_exception(region.error);
}

}  // namespace bagua
