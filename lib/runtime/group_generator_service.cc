// The group generator service; see bagua/runtime/group_generator_service.h.
#include "bagua/runtime/group_generator_service.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/core/errors.h"
#include "bagua/core/logging.h"

namespace bagua {
namespace {

// Message kinds, client to host and host to client.
enum Kind : std::int64_t {
  kRequest = 1,
  kComplete = 2,
  kLeave = 3,
  kClose = 4,
  kLinger = 5,
  kGroupReply = 11,
  kDoneReply = 12,
  kClosedReply = 13,
};
// Header fields before the member list.
constexpr std::size_t kKind = 0, kRank = 1, kGroupId = 2, kCount = 3, kHeader = 4;
// Tags of the two directions on the control communicator.
constexpr std::uint64_t kToHost = 0x4747'0001, kToClient = 0x4747'0002;

double seconds_since_epoch(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

TensorView int64_view(std::vector<std::int64_t>& message) {
  return TensorView{message.data(), static_cast<std::int64_t>(message.size()), DType::kInt64, {}};
}

}  // namespace

GroupGeneratorService::GroupGeneratorService(Communicator& comm, GroupGeneratorOptions options,
                                             int host_rank)
    : options_(options),
      rank_(comm.rank()),
      host_(host_rank),
      message_len_(kHeader + static_cast<std::size_t>(comm.size())) {
  BAGUA_CHECK_ARG(options_.world_size == comm.size(),
                  "group generator: world_size {} differs from the communicator's {} ranks",
                  options_.world_size, comm.size());
  BAGUA_CHECK_ARG(host_ >= 0 && host_ < comm.size(),
                  "group generator: host rank {} is not a rank of the {} ranks", host_,
                  comm.size());
  validate(options_);
  std::vector<int> everyone(static_cast<std::size_t>(comm.size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  control_ = comm.new_group(everyone);  // collective: a context of its own
  if (!is_host()) return;
  engine_.emplace(options_);
  closed_.assign(static_cast<std::size_t>(comm.size()), false);
  last_seen_.assign(static_cast<std::size_t>(comm.size()), std::chrono::steady_clock::now());
  asked_ = last_seen_;
  if (comm.size() > 1) {
    server_ = std::thread([this] { serve(); });
    watchdog_ = std::thread([this] { watch(); });
  }
}

GroupGeneratorService::~GroupGeneratorService() {
  stopping_ = true;
  changed_.notify_all();
  if (server_.joinable()) {
    control_->abort();  // ends the thread's wait for the next message
    server_.join();
  }
  if (watchdog_.joinable()) watchdog_.join();
}

std::optional<Group> GroupGeneratorService::acquire() {
  BAGUA_CHECK_ARG(!executing_, "group generator on rank {}: acquire while group {} still runs",
                  rank_, executing_.value_or(0));
  BAGUA_CHECK_ARG(!closed_self_, "group generator on rank {}: acquire after close", rank_);
  const auto asked = std::chrono::steady_clock::now();
  GroupReply reply;
  if (is_host()) {
    std::unique_lock lock(mutex_);
    rethrow_if_failed();
    asked_[static_cast<std::size_t>(rank_)] = asked;
    reply = engine_->request(rank_);
    auto woken = wake_waiters();
    if (!woken.empty()) {
      lock.unlock();
      send_deliveries(woken);
      lock.lock();
    }
    if (reply.kind == ReplyKind::kWait && !local_reply_) {
      const bool granted = changed_.wait_for(lock, control_->timeout(), [&] {
        return local_reply_.has_value() || failure_ != nullptr;
      });
      rethrow_if_failed();
      if (!granted) {
        throw TimeoutError(
            fmt::format("group generator on rank {} (host): no group granted within {} ms", rank_,
                        control_->timeout().count()));
      }
    }
    if (reply.kind == ReplyKind::kWait) reply = *std::exchange(local_reply_, std::nullopt);
  } else {
    const auto message = ask(kRequest, 0, true);
    if (message[kKind] == kDoneReply) {
      reply.kind = ReplyKind::kDone;
    } else {
      reply.kind = ReplyKind::kGroup;
      reply.group = decode_group(message);
    }
  }
  if (reply.kind == ReplyKind::kDone) {
    left_ = true;  // a lingering rank is told DONE once it left
    return std::nullopt;
  }
  record_acquired(reply.group, asked);
  return reply.group;
}

void GroupGeneratorService::complete(std::uint64_t group_id) {
  BAGUA_CHECK_ARG(executing_ == group_id,
                  "group generator on rank {}: complete({}) but the running group is {}", rank_,
                  group_id, executing_ ? fmt::format("{}", *executing_) : std::string("none"));
  {
    const std::lock_guard lock(record_mutex_);
    executing_.reset();
    if (!history_.empty()) {
      history_.back().t_end = seconds_since_epoch(std::chrono::steady_clock::now());
    }
  }
  if (!is_host()) {
    ask(kComplete, static_cast<std::int64_t>(group_id), false);
    return;
  }
  std::vector<Delivery> deliveries;
  {
    const std::lock_guard lock(mutex_);
    rethrow_if_failed();
    engine_->complete(rank_, group_id);
    deliveries = wake_waiters();
  }
  send_deliveries(deliveries);
}

void GroupGeneratorService::leave() {
  if (left_) return;
  left_ = true;
  announce(kLeave, [this] { engine_->leave(rank_); });
}

void GroupGeneratorService::linger() {
  if (left_ || lingering_) return;
  lingering_ = true;
  announce(kLinger, [this] { engine_->linger(rank_); });
}

void GroupGeneratorService::announce(std::int64_t kind, const std::function<void()>& on_host) {
  if (!is_host()) {
    ask(kind, 0, false);
    return;
  }
  std::vector<Delivery> deliveries;
  {
    const std::lock_guard lock(mutex_);
    rethrow_if_failed();
    on_host();
    deliveries = wake_waiters();
  }
  send_deliveries(deliveries);
}

void GroupGeneratorService::close() {
  if (closed_self_) return;
  BAGUA_CHECK_ARG(left_ && !executing_,
                  "group generator on rank {}: close() needs leave() and every group drained",
                  rank_);
  closed_self_ = true;
  if (!is_host()) {
    ask(kClose, 0, true);
    return;
  }
  {
    std::unique_lock lock(mutex_);
    closed_[static_cast<std::size_t>(rank_)] = true;
    changed_.notify_all();  // the service thread may be waiting for the host alone
    // No bound: the others may train for long; a rank that dies ends the
    // service thread with an error, which ends this wait.
    changed_.wait(lock, [&] { return all_closed() || failure_ != nullptr; });
    rethrow_if_failed();
  }
  if (server_.joinable()) server_.join();
}

GroupGeneratorStats GroupGeneratorService::engine_stats() const {
  BAGUA_CHECK_ARG(is_host(),
                  "group generator: engine statistics live on the host (rank {}), not {}", host_,
                  rank_);
  const std::lock_guard lock(mutex_);
  return engine_->stats();
}

std::vector<ExecutedGroup> GroupGeneratorService::history() const {
  const std::lock_guard lock(record_mutex_);
  return history_;
}

std::vector<double> GroupGeneratorService::acquire_latencies_ms() const {
  const std::lock_guard lock(record_mutex_);
  return latencies_ms_;
}

// -- client side ------------------------------------------------------------

std::vector<std::int64_t> GroupGeneratorService::ask(std::int64_t kind, std::int64_t group_id,
                                                     bool expect_reply) {
  auto message = encode(kind, group_id);
  std::vector<std::int64_t> reply(message_len_, 0);
  const PeerMessage sends[] = {{int64_view(message), host_, kToHost}};
  const PeerMessage receives[] = {{int64_view(reply), host_, kToClient}};
  try {
    // The receive is posted before the request leaves: the host's answer
    // always finds it.
    control_->send_recv(sends, expect_reply ? std::span<const PeerMessage>(receives)
                                            : std::span<const PeerMessage>());
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        fmt::format("group generator on rank {}: no answer from the host (rank {}): {}", rank_,
                    host_, e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("group generator on rank {}: the host (rank {}) failed: {}",
                                   rank_, host_, e.what()));
  }
  return reply;
}

void GroupGeneratorService::record_acquired(const Group& group,
                                            std::chrono::steady_clock::time_point asked) {
  const auto now = std::chrono::steady_clock::now();
  const std::lock_guard lock(record_mutex_);
  executing_ = group.id;
  if (history_.size() >= kHistoryLimit) history_.erase(history_.begin());
  history_.push_back({group, seconds_since_epoch(now), 0.0});
  if (latencies_ms_.size() >= kHistoryLimit) latencies_ms_.erase(latencies_ms_.begin());
  latencies_ms_.push_back(std::chrono::duration<double, std::milli>(now - asked).count());
}

// -- host side --------------------------------------------------------------

void GroupGeneratorService::serve() {
  std::vector<std::int64_t> message(message_len_, 0);
  try {
    while (true) {
      std::vector<int> open;
      {
        const std::lock_guard lock(mutex_);
        if (all_closed()) return;
        for (int r = 0; r < options_.world_size; ++r) {
          if (r != rank_ && !closed_[static_cast<std::size_t>(r)]) open.push_back(r);
        }
      }
      if (open.empty()) {  // only the host itself is still open
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return all_closed(); });
        return;
      }
      const int sender =
          control_->recv_any(int64_view(message), open, kToHost, /*wait_forever=*/true);
      std::vector<Delivery> deliveries;
      {
        const std::lock_guard lock(mutex_);
        last_seen_[static_cast<std::size_t>(sender)] = std::chrono::steady_clock::now();
        deliveries = handle(sender, message);
      }
      send_deliveries(deliveries);
      changed_.notify_all();
    }
  } catch (const BackendError& e) {
    // Gloo names the failed connection by address only: list the ranks the
    // host was serving, one of which failed or exited.
    std::vector<std::string> open;
    {
      const std::lock_guard lock(mutex_);
      for (int r = 0; r < options_.world_size; ++r) {
        if (r != rank_ && !closed_[static_cast<std::size_t>(r)])
          open.push_back(fmt::format("rank {}", r));
      }
    }
    const std::lock_guard lock(mutex_);
    failure_ = std::make_exception_ptr(BackendError(fmt::format(
        "group generator host (rank {}): lost the control channel (one of {} failed or exited): {}",
        rank_, fmt::join(open, ", "), e.what())));
    if (!stopping_) log().error("group generator host (rank {}) stops: {}", rank_, e.what());
    changed_.notify_all();
  } catch (const std::exception& e) {
    if (stopping_) {
      log().debug("group generator host (rank {}) stopped before every rank closed", rank_);
    } else {
      log().error("group generator host (rank {}) stops: {}", rank_, e.what());
    }
    const std::lock_guard lock(mutex_);
    failure_ = std::current_exception();
    changed_.notify_all();
  }
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::handle(
    int sender, const std::vector<std::int64_t>& message) {
  BAGUA_CHECK_INTERNAL(message[kRank] == sender,
                       "group generator: a message from rank {} claims rank {}", sender,
                       message[kRank]);
  switch (message[kKind]) {
    case kRequest: {
      asked_[static_cast<std::size_t>(sender)] = std::chrono::steady_clock::now();
      auto deliveries = deliver(sender, engine_->request(sender));
      auto woken = wake_waiters();
      deliveries.insert(deliveries.end(), woken.begin(), woken.end());
      return deliveries;
    }
    case kComplete:
      engine_->complete(sender, static_cast<std::uint64_t>(message[kGroupId]));
      return wake_waiters();
    case kLeave: engine_->leave(sender); return wake_waiters();
    case kLinger: engine_->linger(sender); return wake_waiters();
    case kClose:
      closed_[static_cast<std::size_t>(sender)] = true;
      return {Delivery{sender, encode(kClosedReply, 0)}};
    default:
      throw InternalError(fmt::format("group generator: unknown message kind {} from rank {}",
                                      message[kKind], sender));
  }
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::wake_waiters() {
  std::vector<Delivery> deliveries;
  for (int rank : engine_->waiting()) {
    auto more = deliver(rank, engine_->poll(rank));
    deliveries.insert(deliveries.end(), more.begin(), more.end());
  }
  return deliveries;
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::deliver(
    int rank, const GroupReply& reply) {
  if (reply.kind == ReplyKind::kWait) return {};
  if (rank == rank_) {  // the host's own acquire() waits for it
    local_reply_ = reply;
    changed_.notify_all();
    return {};
  }
  if (reply.kind == ReplyKind::kDone) return {Delivery{rank, encode(kDoneReply, 0)}};
  return {Delivery{
      rank, encode(kGroupReply, static_cast<std::int64_t>(reply.group.id), reply.group.ranks)}};
}

void GroupGeneratorService::send_deliveries(const std::vector<Delivery>& deliveries) {
  if (deliveries.empty()) return;
  const std::lock_guard lock(send_mutex_);
  for (auto delivery : deliveries) {
    const PeerMessage sends[] = {{int64_view(delivery.message), delivery.rank, kToClient}};
    control_->send_recv(sends, {});
  }
}

void GroupGeneratorService::watch() {
  const auto period = std::max(std::chrono::milliseconds(10), control_->timeout() / 10);
  std::unique_lock lock(mutex_);
  while (!stopping_ && !all_closed() && failure_ == nullptr) {
    changed_.wait_for(lock, period);
    check_silent_ranks();
    const auto released = release_idle_lingerers();
    if (released.empty()) continue;
    lock.unlock();
    send_deliveries(released);
    lock.lock();
  }
}

void GroupGeneratorService::check_silent_ranks() {
  if (failure_ != nullptr || stopping_) return;
  const auto now = std::chrono::steady_clock::now();
  last_seen_[static_cast<std::size_t>(rank_)] = now;  // the host's own calls need no message
  for (int r = 0; r < options_.world_size; ++r) {
    const auto x = static_cast<std::size_t>(r);
    if (closed_[x] || now - last_seen_[x] < control_->timeout()) continue;
    const auto queued = engine_->buffer(r);
    const auto running = engine_->executing(r);
    if (queued.empty() && !running) continue;  // nobody waits for it
    const auto group = running ? running->id : queued.front().id;
    const double silent = std::chrono::duration<double>(now - last_seen_[x]).count();
    failure_ = std::make_exception_ptr(TimeoutError(fmt::format(
        "group generator host (rank {}): rank {} holds group {} and has not contacted the host "
        "for {:.1f} s (timeout {} ms): presumed dead",
        rank_, r, group, silent, control_->timeout().count())));
    log().error(
        "group generator host (rank {}): rank {} silent for {:.1f} s while holding group {}", rank_,
        r, silent, group);
    changed_.notify_all();
    return;
  }
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::release_idle_lingerers() {
  if (failure_ != nullptr || stopping_) return {};
  const auto now = std::chrono::steady_clock::now();
  bool released = false;
  for (int r : engine_->waiting()) {
    if (!engine_->is_lingering(r) ||
        now - asked_[static_cast<std::size_t>(r)] < control_->timeout() / 2) {
      continue;
    }
    log().info(
        "group generator host (rank {}): rank {} lingered unchosen for half the timeout; "
        "it leaves",
        rank_, r);
    engine_->leave(r);
    released = true;
  }
  return released ? wake_waiters() : std::vector<Delivery>{};
}

void GroupGeneratorService::rethrow_if_failed() const {
  if (failure_) std::rethrow_exception(failure_);
}

bool GroupGeneratorService::all_closed() const {
  return std::all_of(closed_.begin(), closed_.end(), [](bool c) { return c; });
}

std::vector<std::int64_t> GroupGeneratorService::encode(std::int64_t kind, std::int64_t group_id,
                                                        const std::vector<int>& ranks) const {
  std::vector<std::int64_t> message(message_len_, 0);
  message[kKind] = kind;
  message[kRank] = rank_;
  message[kGroupId] = group_id;
  message[kCount] = static_cast<std::int64_t>(ranks.size());
  std::copy(ranks.begin(), ranks.end(), message.begin() + static_cast<std::ptrdiff_t>(kHeader));
  return message;
}

Group GroupGeneratorService::decode_group(const std::vector<std::int64_t>& message) const {
  BAGUA_CHECK_INTERNAL(message[kKind] == kGroupReply,
                       "group generator on rank {}: unexpected reply kind {}", rank_,
                       message[kKind]);
  Group group;
  group.id = static_cast<std::uint64_t>(message[kGroupId]);
  const auto count = static_cast<std::size_t>(message[kCount]);
  for (std::size_t i = 0; i < count; ++i) {
    group.ranks.push_back(static_cast<int>(message[kHeader + i]));
  }
  return group;
}

}  // namespace bagua
