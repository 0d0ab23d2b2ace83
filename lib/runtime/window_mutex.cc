// win_mutex: passive-target locks on windows. A rank's own mutex is a queue
// of ranks in its window; a peer's is taken with a LOCK request, granted by
// the reply (see window_server.cc).
#include "bagua/runtime/window_service.h"

#include <algorithm>

#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "runtime/window_protocol.h"

namespace bagua {

using namespace window_protocol;

void WindowService::lock(const std::string& name, std::vector<int> ranks) {
  const std::lock_guard client(client_mutex_);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  const auto id = window_id(name);
  {
    const auto [w, lock] = lock_window(id);
    BAGUA_CHECK_ARG(w != nullptr, "win_mutex on rank {}: no window '{}'", rank_, name);
  }
  std::vector<int> held;
  try {
    for (int r : ranks) {
      BAGUA_CHECK_ARG(r >= 0 && r < size_, "win_mutex on rank {} (window '{}'): no rank {}", rank_,
                      name, r);
      if (r == rank_) {
        lock_local(name, id);
      } else {
        lock_one(name, id, r);
      }
      held.push_back(r);
    }
  } catch (...) {
    for (auto it = held.rbegin(); it != held.rend(); ++it) {
      try {
        if (*it == rank_) {
          unlock_local(name, id);
        } else {
          unlock_one(name, id, *it);
        }
      } catch (const std::exception& e) {
        log().warn("win_mutex on rank {} (window '{}'): releasing after a failure: {}", rank_, name,
                   e.what());
      }
    }
    throw;
  }
}

void WindowService::unlock(const std::string& name, std::vector<int> ranks) {
  const std::lock_guard client(client_mutex_);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  const auto id = window_id(name);
  for (auto it = ranks.rbegin(); it != ranks.rend(); ++it) {
    if (*it == rank_) {
      unlock_local(name, id);
    } else {
      unlock_one(name, id, *it);
    }
  }
}

void WindowService::lock_one(const std::string& name, std::uint64_t id, int owner) {
  Request request{.op = kLock, .id = static_cast<std::int64_t>(id), .source = rank_};
  call(request, owner, {}, {}, std::string(op_name(kLock)), name);
}

void WindowService::unlock_one(const std::string& name, std::uint64_t id, int owner) {
  Request request{.op = kUnlock, .id = static_cast<std::int64_t>(id), .source = rank_};
  call(request, owner, {}, {}, std::string(op_name(kUnlock)), name);
}

void WindowService::lock_local(const std::string& name, std::uint64_t id) {
  // The caller holds client_mutex_, so the window cannot be freed meanwhile.
  auto [w, lock] = lock_window(id);
  if (w == nullptr) {
    throw InvalidArgument(fmt::format("{}: no such window", where("win_mutex acquire", name)));
  }
  auto& queue = w->mutex_queue;
  queue.push_back(rank_);
  const bool granted = w->granted.wait_for(
      lock, channel_->timeout(), [&] { return queue.front() == rank_ || failed_.load(); });
  if (granted && !failed_.load()) return;
  queue.erase(std::find(queue.begin(), queue.end(), rank_));
  const int holder = queue.empty() ? -1 : queue.front();
  lock.unlock();
  {
    const std::lock_guard state(state_mutex_);
    rethrow_if_failed();
  }
  throw TimeoutError(fmt::format("{}: its own mutex, held by rank {}, not granted within {} ms",
                                 where("win_mutex acquire", name), holder,
                                 channel_->timeout().count()));
}

void WindowService::unlock_local(const std::string& name, std::uint64_t id) {
  int next = -1;
  {
    const auto [w, lock] = lock_window(id, false);
    if (w == nullptr) {
      throw InvalidArgument(fmt::format("{}: no such window", where("win_mutex release", name)));
    }
    BAGUA_CHECK_ARG(!w->mutex_queue.empty() && w->mutex_queue.front() == rank_,
                    "{}: rank {} does not hold its own mutex", where("win_mutex release", name),
                    rank_);
    w->mutex_queue.pop_front();
    if (!w->mutex_queue.empty()) next = w->mutex_queue.front();
  }
  // A remote waiter's grant is the reply to its LOCK (this rank, the holder,
  // was at the front, so the next one is another rank).
  if (next >= 0) reply(next, Reply{});
}

}  // namespace bagua
