// One-sided windows; see bagua/runtime/window_service.h. This file: the
// service's life, its collective calls (create, free) and local reads; the
// wire protocol is runtime/window_protocol.h.
#include "bagua/runtime/window_service.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/core/errors.h"
#include "runtime/window_protocol.h"

namespace bagua {

using namespace window_protocol;

std::uint64_t window_id(const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

WindowService::WindowService(Communicator& comm, WindowServiceOptions options)
    : options_(options), rank_(comm.rank()), size_(comm.size()) {
  BAGUA_CHECK_ARG(options_.chunk_bytes > 0, "window service: chunk_bytes must be positive");
  BAGUA_CHECK_ARG(comm.backend_name().find("gloo") != std::string::npos,
                  "window service on rank {}: needs a Gloo communicator (any-source receive), "
                  "got {}",
                  rank_, comm.backend_name());
  std::vector<int> everyone(static_cast<std::size_t>(size_));
  std::iota(everyone.begin(), everyone.end(), 0);
  channel_ = comm.new_group(everyone);
  collectives_ = comm.new_group(everyone);
  if (size_ > 1) server_ = std::thread([this] { serve(); });
}

WindowService::~WindowService() {
  stopping_ = true;
  if (server_.joinable()) {
    channel_->abort();  // ends the thread's wait for the next request
    server_.join();
  }
}

std::string WindowService::where(const std::string& op, const std::string& name) const {
  return fmt::format("{} on rank {} (window '{}')", op, rank_, name);
}

void WindowService::rethrow_if_failed() const {
  if (failure_) std::rethrow_exception(failure_);
}

WindowService::Window* WindowService::find(std::uint64_t id) const {
  auto it = windows_.find(id);
  return it == windows_.end() ? nullptr : it->second.get();
}

WindowService::Locked WindowService::lock_window(std::uint64_t id, bool check_failure) const {
  const std::lock_guard lock(state_mutex_);
  if (check_failure) rethrow_if_failed();
  Locked found;
  found.window = find(id);
  if (found.window != nullptr) found.lock = std::unique_lock(found.window->mutex);
  return found;
}

// -- collective calls -------------------------------------------------------

bool WindowService::create(const std::string& name, const TensorView& tensor,
                           std::vector<int> sources, bool zero_init, std::string refusal) {
  BAGUA_CHECK_ARG(!name.empty(), "win_create on rank {}: the window needs a name", rank_);
  const std::lock_guard client(client_mutex_);
  const auto id = window_id(name);
  // A rank's own refusal (bad tensor or sources) still joins the agreement
  // below, so the others fail too instead of waiting for it.
  if (!refusal.empty()) {
    refusal = fmt::format("rank {}: {}", rank_, refusal);
  } else if (tensor.device.type != DeviceType::kCPU) {
    refusal = fmt::format("rank {}: window tensors must be in host memory, got {}", rank_,
                          tensor.device.str());
  } else if (tensor.dtype != DType::kFloat32 && tensor.dtype != DType::kFloat64) {
    refusal = fmt::format("rank {}: windows hold float32 or float64 tensors, got {}", rank_,
                          to_string(tensor.dtype));
  }
  std::sort(sources.begin(), sources.end());
  for (int s : sources) {
    if (s < 0 || s >= size_ || s == rank_ || std::count(sources.begin(), sources.end(), s) != 1) {
      refusal = fmt::format("rank {}: bad in-neighbour list [{}]", rank_, fmt::join(sources, ", "));
    }
  }
  bool added = false;
  {
    const std::lock_guard lock(state_mutex_);
    rethrow_if_failed();
    if (refusal.empty() && find(id) == nullptr) {
      auto w = std::make_unique<Window>();
      w->name = name;
      w->tensor = tensor;
      for (int s : sources) {
        auto& buffer = w->buffers[s];
        buffer.resize(tensor.nbytes());
        if (!zero_init && tensor.nbytes() > 0) {
          std::memcpy(buffer.data(), tensor.data, tensor.nbytes());
        }
        w->versions[s] = 0;
        w->buffer_p[s] = 0.0;
      }
      windows_.emplace(id, std::move(w));
      added = true;
    } else if (refusal.empty() && windows_.at(id)->name != name) {
      refusal = fmt::format("rank {}: window names '{}' and '{}' share an id", rank_, name,
                            windows_.at(id)->name);
    }
  }
  // Every rank's {added, numel, dtype}: registered before the agreement, so
  // no rank can reach a peer's window before it exists.
  std::vector<std::int64_t> mine{added ? 1 : 0, refusal.empty() ? 0 : 1, tensor.numel,
                                 static_cast<std::int64_t>(tensor.dtype)};
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size_));
  try {
    agree("win_create", name, int64_view(mine.data(), mine.size()),
          int64_view(all.data(), all.size()));
  } catch (...) {
    if (added) {
      const std::lock_guard lock(state_mutex_);
      { const std::lock_guard users(windows_.at(id)->mutex); }
      windows_.erase(id);
    }
    throw;
  }
  bool everyone_added = true;
  std::vector<std::string> problems;
  for (int r = 0; r < size_; ++r) {
    const auto* row = &all[static_cast<std::size_t>(r) * mine.size()];
    everyone_added = everyone_added && row[0] == 1;
    if (row[1] != 0) problems.push_back(fmt::format("rank {} refused its arguments", r));
    if (row[2] != tensor.numel || row[3] != mine[3]) {
      problems.push_back(fmt::format("rank {} has {} elements of dtype #{}", r, row[2], row[3]));
    }
  }
  if (!everyone_added || !problems.empty()) {
    if (added) {
      const std::lock_guard lock(state_mutex_);
      { const std::lock_guard users(windows_.at(id)->mutex); }
      windows_.erase(id);
    }
  }
  if (!refusal.empty()) throw InvalidArgument(fmt::format("win_create '{}': {}", name, refusal));
  if (!problems.empty()) {
    throw InvalidArgument(fmt::format("win_create '{}' on rank {} ({} elements): {}", name, rank_,
                                      tensor.numel, fmt::join(problems, "; ")));
  }
  return everyone_added;
}

bool WindowService::free(const std::string& name) {
  // Holding the client lock: this rank's ops are all acknowledged, so after
  // the agreement no request for the window is in flight anywhere.
  const std::lock_guard client(client_mutex_);
  std::int64_t have = 1;
  {
    const std::lock_guard lock(state_mutex_);
    rethrow_if_failed();
    if (!name.empty()) have = find(window_id(name)) != nullptr ? 1 : 0;
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(size_));
  agree("win_free", name.empty() ? "(all)" : name, int64_view(&have, 1),
        int64_view(all.data(), all.size()));
  if (std::find(all.begin(), all.end(), 0) != all.end()) return false;
  const std::lock_guard lock(state_mutex_);
  for (auto it = windows_.begin(); it != windows_.end();) {
    if (!name.empty() && it->first != window_id(name)) {
      ++it;
      continue;
    }
    // Whoever found the window under its mutex finishes before it goes.
    { const std::lock_guard users(it->second->mutex); }
    it = windows_.erase(it);
  }
  return true;
}

void WindowService::agree(const std::string& op, const std::string& name, const TensorView& mine,
                          const TensorView& all) {
  try {
    collectives_->allgather(mine, all);
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        fmt::format("{}: not every rank joined within {} ms (a rank that never "
                    "calls it, or is gone): {}",
                    where(op, name), collectives_->timeout().count(), e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: a rank failed or exited: {}", where(op, name), e.what()));
  }
}

std::vector<std::string> WindowService::names() const {
  const std::lock_guard lock(state_mutex_);
  std::vector<std::string> out;
  for (const auto& [id, w] : windows_) out.push_back(w->name);
  std::sort(out.begin(), out.end());
  return out;
}

bool WindowService::exists(const std::string& name) const {
  const std::lock_guard lock(state_mutex_);
  return windows_.count(window_id(name)) != 0;
}

// -- local reads ------------------------------------------------------------

std::map<int, std::int64_t> WindowService::versions(const std::string& name) const {
  const auto [w, lock] = lock_window(window_id(name), false);
  BAGUA_CHECK_ARG(w != nullptr, "get_win_version on rank {}: no window '{}'", rank_, name);
  return w->versions;
}

double WindowService::associated_p(const std::string& name) const {
  const auto [w, lock] = lock_window(window_id(name), false);
  BAGUA_CHECK_ARG(w != nullptr, "win_associated_p on rank {}: no window '{}'", rank_, name);
  return w->p;
}

std::vector<std::byte> WindowService::buffer(const std::string& name, int source) const {
  const auto [w, lock] = lock_window(window_id(name), false);
  BAGUA_CHECK_ARG(w != nullptr, "window buffer on rank {}: no window '{}'", rank_, name);
  auto b = w->buffers.find(source);
  BAGUA_CHECK_ARG(b != w->buffers.end(),
                  "window buffer on rank {}: window '{}' has no buffer for rank {}", rank_, name,
                  source);
  return b->second;
}

}  // namespace bagua
