// The group generator service; see bagua/runtime/group_generator_service.h.
#include "bagua/runtime/group_generator_service.h"

#include <algorithm>
#include <cmath>
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
  kFailedReply = 14,  // group id: the group the lost rank held; members: the lost ranks
};
// Header fields before the member list.
constexpr std::size_t kKind = 0, kRank = 1, kGroupId = 2, kCount = 3, kMaxBuffer = 4, kHeader = 5;
// A REQUEST has no group id: its place carries the sender's previous
// request's round trip in microseconds.
constexpr std::size_t kRoundTrip = kGroupId;
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
  awaiting_.assign(static_cast<std::size_t>(comm.size()), false);
  told_ = awaiting_;
  last_seen_.assign(static_cast<std::size_t>(comm.size()), std::chrono::steady_clock::now());
  asked_ = last_seen_;
  host_thread_ = std::thread([this] { serve_host(); });
  if (comm.size() == 1) return;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != rank_) receivers_.emplace_back([this, r] { serve_rank(r); });
  }
  watchdog_ = std::thread([this] { watch(); });
}

GroupGeneratorService::~GroupGeneratorService() {
  if (!receivers_.empty()) tell_clients_before_leaving();
  {
    const std::lock_guard lock(mutex_);  // no thread misses it between its check and its wait
    stopping_ = true;
  }
  changed_.notify_all();
  if (!receivers_.empty()) control_->abort();  // ends the threads' waits for the next message
  for (auto& receiver : receivers_) receiver.join();
  if (watchdog_.joinable()) watchdog_.join();
  if (host_thread_.joinable()) host_thread_.join();
}

void GroupGeneratorService::tell_clients_before_leaving() {
  const auto grace =
      std::min<std::chrono::milliseconds>(control_->timeout() / 4, std::chrono::seconds(2));
  std::unique_lock lock(mutex_);
  if (failure_ == nullptr || lost_.empty()) return;
  changed_.wait_for(lock, grace, [&] {
    for (std::size_t r = 0; r < closed_.size(); ++r) {
      if (static_cast<int>(r) != rank_ && !closed_[r] && !told_[r]) return false;
    }
    return true;
  });
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
    inbox_.push_back({asked, encode(kRequest, 0)});
    changed_.notify_all();
    const bool answered = changed_.wait_for(
        lock, control_->timeout(), [&] { return local_reply_.has_value() || failure_ != nullptr; });
    rethrow_if_failed();
    if (!answered) {
      throw TimeoutError(
          fmt::format("group generator on rank {} (host): no group granted within {} ms", rank_,
                      control_->timeout().count()));
    }
    reply = *std::exchange(local_reply_, std::nullopt);
    if (reply.kind == ReplyKind::kDone) final_round_id_ = engine_->final_round_id();
    const std::lock_guard record(record_mutex_);
    max_buffer_len_ = engine_->stats().max_buffer_len;
  } else {
    const auto message = ask(kRequest, last_round_trip_us_, true);
    if (message[kKind] == kDoneReply) {
      reply.kind = ReplyKind::kDone;
      // Group ids start at 1: 0 says some rank left before the end.
      if (message[kGroupId] > 0) final_round_id_ = static_cast<std::uint64_t>(message[kGroupId]);
    } else {
      reply.kind = ReplyKind::kGroup;
      reply.group = decode_group(message);
      const std::lock_guard record(record_mutex_);
      max_buffer_len_ = message[kMaxBuffer];
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
  announce(kComplete, static_cast<std::int64_t>(group_id));
}

void GroupGeneratorService::leave() {
  if (left_) return;
  left_ = true;
  announce(kLeave, 0);
}

void GroupGeneratorService::linger() {
  if (left_ || lingering_) return;
  lingering_ = true;
  announce(kLinger, 0);
}

void GroupGeneratorService::announce(std::int64_t kind, std::int64_t group_id) {
  if (!is_host()) {
    ask(kind, group_id, false);
    return;
  }
  const std::lock_guard lock(mutex_);
  rethrow_if_failed();
  inbox_.push_back({std::chrono::steady_clock::now(), encode(kind, group_id)});
  changed_.notify_all();
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
  for (auto& receiver : receivers_) receiver.join();
  receivers_.clear();
}

GroupGeneratorStats GroupGeneratorService::engine_stats() const {
  BAGUA_CHECK_ARG(is_host(),
                  "group generator: engine statistics live on the host (rank {}), not {}", host_,
                  rank_);
  const std::lock_guard lock(mutex_);
  return engine_->stats();
}

std::int64_t GroupGeneratorService::max_buffer_len() const {
  const std::lock_guard lock(record_mutex_);
  return max_buffer_len_;
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
  if (expect_reply && reply[kKind] == kFailedReply) raise_failed(reply);
  return reply;
}

void GroupGeneratorService::raise_failed(const std::vector<std::int64_t>& message) const {
  std::vector<std::int64_t> lost(message.begin() + static_cast<std::ptrdiff_t>(kHeader),
                                 message.begin() + static_cast<std::ptrdiff_t>(kHeader) +
                                     static_cast<std::ptrdiff_t>(message[kCount]));
  throw BackendError(fmt::format(
      "group generator on rank {}: rank {} failed ({}; the host, rank {}, lost it): no more "
      "groups",
      rank_, fmt::join(lost, ", rank "),
      message[kGroupId] == 0 ? std::string("it held no group")
                             : fmt::format("it held group {}", message[kGroupId]),
      host_));
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
  last_round_trip_us_ = std::chrono::duration_cast<std::chrono::microseconds>(now - asked).count();
}

// -- host side --------------------------------------------------------------

void GroupGeneratorService::serve_rank(int rank) {
  const auto r = static_cast<std::size_t>(rank);
  std::vector<std::int64_t> message(message_len_, 0);
  while (true) {
    {
      const std::lock_guard lock(mutex_);
      if (closed_[r] || stopping_) return;
    }
    try {
      control_->recv_from(int64_view(message), rank, kToHost, /*wait_forever=*/true);
    } catch (const std::exception& e) {
      if (!stopping_) connection_lost(rank, e.what());
      return;
    }
    std::vector<Delivery> deliveries;
    try {
      const std::lock_guard lock(mutex_);
      last_seen_[r] = std::chrono::steady_clock::now();
      deliveries = failure_ ? handle_after_failure(rank, message) : handle(rank, message);
    } catch (const std::exception& e) {  // a protocol error: the service cannot go on
      log().error("group generator host (rank {}) stops: {}", rank_, e.what());
      const std::lock_guard lock(mutex_);
      if (!failure_) failure_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    send_deliveries(deliveries);
    changed_.notify_all();
  }
}

void GroupGeneratorService::serve_host() {
  std::unique_lock lock(mutex_);
  while (true) {
    // Idle between the host's calls without a bound; the destructor ends it.
    changed_.wait(lock, [&] { return !inbox_.empty() || stopping_; });
    if (stopping_) return;
    const auto [posted, message] = std::move(inbox_.front());
    inbox_.pop_front();
    // As long as the clients' messages take: a request the round trip, a
    // completion the way there (until then a client counts as busy).
    const auto delay = message[kKind] == kRequest    ? clients_round_trip()
                       : message[kKind] == kComplete ? clients_round_trip() / 2
                                                     : std::chrono::microseconds(0);
    if (delay.count() > 0) {
      lock.unlock();
      std::this_thread::sleep_until(posted + delay);
      lock.lock();
    }
    std::vector<Delivery> deliveries;
    try {
      if (failure_ == nullptr) deliveries = handle(rank_, message);
    } catch (const std::exception& e) {  // the engine refused: the service cannot go on
      log().error("group generator host (rank {}) stops: {}", rank_, e.what());
      failure_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    lock.unlock();
    send_deliveries(deliveries);
    lock.lock();
  }
}

std::chrono::microseconds GroupGeneratorService::clients_round_trip() const {
  return std::chrono::microseconds(std::llround(std::min(round_trip_us_, 20000.0)));
}

void GroupGeneratorService::connection_lost(int rank, const std::string& what) {
  std::vector<Delivery> deliveries;
  {
    const std::lock_guard lock(mutex_);
    if (closed_[static_cast<std::size_t>(rank)]) return;  // it closed, then exited
    closed_[static_cast<std::size_t>(rank)] = true;
    if (failure_) {
      changed_.notify_all();
      return;
    }
    log().error("group generator host (rank {}): rank {}'s connection failed: {}", rank_, rank,
                what);
    deliveries = fail({rank}, fmt::format("its connection to the host closed ({})", what));
  }
  send_deliveries(deliveries);
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::fail(
    std::vector<int> ranks, const std::string& reason) {
  const std::string held = groups_held(ranks);
  const auto running = engine_->executing(ranks.front());
  const auto queued = engine_->buffer(ranks.front());
  lost_group_ = running ? running->id : (queued.empty() ? 0 : queued.front().id);
  lost_ = std::move(ranks);
  failure_ = std::make_exception_ptr(
      BackendError(fmt::format("group generator host (rank {}): rank {} failed: {}; {}", rank_,
                               fmt::join(lost_, ", rank "), reason, held)));
  changed_.notify_all();
  std::vector<Delivery> notices;
  for (int r = 0; r < options_.world_size; ++r) {
    if (awaiting_[static_cast<std::size_t>(r)]) notices.push_back(answer(r, {}));
  }
  return notices;
}

std::string GroupGeneratorService::groups_held(const std::vector<int>& ranks) const {
  std::vector<std::string> held;
  for (int r : ranks) {
    auto groups = engine_->buffer(r);
    if (auto running = engine_->executing(r)) groups.insert(groups.begin(), *running);
    for (const auto& g : groups) {
      held.push_back(
          fmt::format("rank {} held group {} (ranks {})", r, g.id, fmt::join(g.ranks, ",")));
    }
  }
  return held.empty() ? std::string("it held no group") : fmt::format("{}", fmt::join(held, ", "));
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::handle(
    int sender, const std::vector<std::int64_t>& message) {
  BAGUA_CHECK_INTERNAL(message[kRank] == sender,
                       "group generator: a message from rank {} claims rank {}", sender,
                       message[kRank]);
  switch (message[kKind]) {
    case kRequest: {
      asked_[static_cast<std::size_t>(sender)] = std::chrono::steady_clock::now();
      if (sender != rank_ && message[kRoundTrip] > 0) {  // a client's previous request
        round_trip_us_ += (static_cast<double>(message[kRoundTrip]) - round_trip_us_) / 16;
      }
      // The host's own reply goes to local_reply_ (deliver), not answer().
      awaiting_[static_cast<std::size_t>(sender)] = sender != rank_;
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
      awaiting_[static_cast<std::size_t>(sender)] = true;
      return {answer(sender, encode(kClosedReply, 0))};
    default:
      throw InternalError(fmt::format("group generator: unknown message kind {} from rank {}",
                                      message[kKind], sender));
  }
}

// After a failure the engine is left alone: requests get FAILED, closes
// their CLOSED, the rest needs no answer.
std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::handle_after_failure(
    int sender, const std::vector<std::int64_t>& message) {
  const auto r = static_cast<std::size_t>(sender);
  if (message[kKind] == kRequest) {
    awaiting_[r] = true;
    return {answer(sender, {})};
  }
  if (message[kKind] == kClose) {
    closed_[r] = true;
    awaiting_[r] = true;
    return {answer(sender, encode(kClosedReply, 0))};
  }
  return {};
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
  if (reply.kind == ReplyKind::kDone) {
    const auto final_round = engine_->final_round_id().value_or(0);
    return {answer(rank, encode(kDoneReply, static_cast<std::int64_t>(final_round)))};
  }
  return {answer(
      rank, encode(kGroupReply, static_cast<std::int64_t>(reply.group.id), reply.group.ranks))};
}

// The one answer to `rank`'s outstanding REQUEST or CLOSE; an empty message
// becomes FAILED, naming the lost ranks.
GroupGeneratorService::Delivery GroupGeneratorService::answer(int rank,
                                                              std::vector<std::int64_t> message) {
  BAGUA_CHECK_INTERNAL(awaiting_[static_cast<std::size_t>(rank)],
                       "group generator host: a second answer to rank {}", rank);
  awaiting_[static_cast<std::size_t>(rank)] = false;
  const bool failed = message.empty();
  if (failed) message = encode(kFailedReply, static_cast<std::int64_t>(lost_group_), lost_);
  message[kMaxBuffer] = engine_->stats().max_buffer_len;
  return Delivery{rank, std::move(message), failed};
}

void GroupGeneratorService::send_deliveries(const std::vector<Delivery>& deliveries) {
  for (auto delivery : deliveries) {
    try {
      const std::lock_guard lock(send_mutex_);
      const PeerMessage sends[] = {{int64_view(delivery.message), delivery.rank, kToClient}};
      control_->send_recv(sends, {});
    } catch (const std::exception& e) {  // its receive was posted: its connection failed
      if (!stopping_) connection_lost(delivery.rank, e.what());
      continue;
    }
    if (delivery.failed) {
      // Told only once sent: a host leaving after a failure waits for this
      // (tell_clients_before_leaving), so its closing connections cannot
      // overtake the message that names the lost rank (it did under ASan).
      {
        const std::lock_guard lock(mutex_);
        told_[static_cast<std::size_t>(delivery.rank)] = true;
      }
      changed_.notify_all();
    }
  }
}

void GroupGeneratorService::watch() {
  const auto period = std::max(std::chrono::milliseconds(10), control_->timeout() / 10);
  std::unique_lock lock(mutex_);
  while (!stopping_ && !all_closed() && failure_ == nullptr) {
    changed_.wait_for(lock, period);
    auto deliveries = check_silent_ranks();
    if (deliveries.empty()) deliveries = release_idle_lingerers();
    if (deliveries.empty()) continue;
    lock.unlock();
    send_deliveries(deliveries);
    lock.lock();
  }
}

std::vector<GroupGeneratorService::Delivery> GroupGeneratorService::check_silent_ranks() {
  if (failure_ != nullptr || stopping_) return {};
  const auto now = std::chrono::steady_clock::now();
  last_seen_[static_cast<std::size_t>(rank_)] = now;  // the host's own calls need no message
  for (int r = 0; r < options_.world_size; ++r) {
    const auto x = static_cast<std::size_t>(r);
    if (closed_[x] || now - last_seen_[x] < control_->timeout()) continue;
    if (engine_->buffer(r).empty() && !engine_->executing(r)) continue;  // nobody waits for it
    const auto lost = control_->lost_peers();
    const bool gone = std::find(lost.begin(), lost.end(), r) != lost.end();
    const double silent = std::chrono::duration<double>(now - last_seen_[x]).count();
    log().error("group generator host (rank {}): rank {} silent for {:.1f} s while holding a group",
                rank_, r, silent);
    return fail({r}, fmt::format("it has not contacted the host for {:.1f} s (timeout {} ms) while "
                                 "others wait for it, and its connection is {}",
                                 silent, control_->timeout().count(),
                                 gone ? "lost: presumed dead"
                                      : "open: alive but stuck, or failed without exiting"));
  }
  return {};
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
