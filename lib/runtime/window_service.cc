// One-sided windows; see bagua/runtime/window_service.h.
#include "bagua/runtime/window_service.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/core/errors.h"
#include "bagua/core/logging.h"

namespace bagua {
namespace {

enum Op : std::int64_t { kPut = 1, kAccumulate = 2, kGet = 3, kLock = 4, kUnlock = 5 };

// Why a target refused a request (the reply's status).
enum Status : std::int64_t {
  kOk = 0,
  kNoWindow = 1,
  kNoBuffer = 2,
  kWrongSize = 3,
  kNotHolder = 4,
};

std::string_view op_name(std::int64_t op) {
  switch (op) {
    case kPut: return "win_put";
    case kAccumulate: return "win_accumulate";
    case kGet: return "win_get";
    case kLock: return "win_mutex acquire";
    case kUnlock: return "win_mutex release";
    default: return "unknown window op";
  }
}

// Tags on the service channel: request headers, replies, and the data chunks
// of each direction (chunk i on base + i, so a chunk can only land in its own
// place).
constexpr std::uint64_t kRequestTag = 0x5749'0001;
constexpr std::uint64_t kReplyTag = 0x5749'0002;
constexpr std::uint64_t kRequestData = 0x57ULL << 48 | 1ULL << 40;
constexpr std::uint64_t kReplyData = 0x57ULL << 48 | 2ULL << 40;

double as_double(std::int64_t bits) { return std::bit_cast<double>(bits); }
std::int64_t as_bits(double value) { return std::bit_cast<std::int64_t>(value); }

TensorView int64_view(std::int64_t* data, std::size_t count) {
  return TensorView{data, static_cast<std::int64_t>(count), DType::kInt64, {}};
}

TensorView byte_view(std::span<std::byte> bytes) {
  return TensorView{bytes.data(), static_cast<std::int64_t>(bytes.size()), DType::kUInt8, {}};
}

std::size_t chunk_count(std::size_t bytes, std::size_t chunk) {
  return bytes == 0 ? 0 : (bytes + chunk - 1) / chunk;
}

// The chunks of `bytes` as messages to / from `peer`, tagged base + index.
std::vector<PeerMessage> chunks(std::span<std::byte> bytes, std::size_t chunk, int peer,
                                std::uint64_t base) {
  std::vector<PeerMessage> out;
  for (std::size_t i = 0; i < chunk_count(bytes.size(), chunk); ++i) {
    const std::size_t offset = i * chunk;
    const std::size_t n = std::min(chunk, bytes.size() - offset);
    out.push_back({byte_view(bytes.subspan(offset, n)), peer, base + i});
  }
  return out;
}

// dst := (accumulate ? dst : 0) + weight * src, elementwise in T.
void scale_into(std::byte* dst, const std::byte* src, std::int64_t numel, DType dtype,
                double weight, bool accumulate) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto* d = reinterpret_cast<T*>(dst);
    const auto* s = reinterpret_cast<const T*>(src);
    const T w = static_cast<T>(weight);
    for (std::int64_t i = 0; i < numel; ++i) d[i] = accumulate ? d[i] + w * s[i] : w * s[i];
  };
  if (dtype == DType::kFloat64) {
    run(double{});
  } else {
    run(float{});
  }
}

void scale_in_place(const TensorView& x, double weight) {
  if (weight == 1.0) return;
  scale_into(x.bytes(), x.bytes(), x.numel, x.dtype, weight, false);
}

}  // namespace

std::uint64_t window_id(const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Request header: fixed size, so the any-source receive knows its length.
struct WindowService::Request {
  std::int64_t op = 0;
  std::int64_t id = 0;  // window_id's bits
  std::int64_t source = -1;
  std::int64_t weight = 0;  // double bits
  std::int64_t p = 0;       // double bits: weight * the sender's p
  std::int64_t nbytes = 0;
  std::int64_t with_p = 0;
  std::int64_t reserved = 0;
};
struct WindowService::Reply {
  std::int64_t status = kOk;
  std::int64_t p = 0;  // GET: the target's p (double bits)
  std::int64_t nbytes = 0;
  std::int64_t reserved = 0;
};

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

// -- client side ------------------------------------------------------------

// "rank 3" or "ranks 1, 2" (of a call to several peers, where the failing
// one is not known).
std::string peers_text(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "one of ranks", fmt::join(ranks, ", "));
}

std::vector<WindowService::Reply> WindowService::call_all(std::span<const Exchange> exchanges,
                                                          const std::string& op,
                                                          const std::string& name) {
  std::vector<Request> headers;
  std::vector<int> peers;
  for (const auto& e : exchanges) {
    headers.push_back(*e.request);
    peers.push_back(e.peer);
  }
  std::vector<Reply> answers(exchanges.size());
  try {
    // Every receive of the replies (headers and data) is posted before the
    // requests leave: a peer's server that answers this rank must never
    // wait for it, since this rank may be waiting for another peer whose
    // server waits in turn (gets among every pair of ranks at once would
    // otherwise deadlock). Each wait still has the whole timeout.
    std::vector<PeerMessage> sends;
    std::vector<PeerMessage> receives;
    for (std::size_t k = 0; k < exchanges.size(); ++k) {
      const auto& e = exchanges[k];
      sends.push_back(
          {int64_view(reinterpret_cast<std::int64_t*>(&headers[k]), 8), e.peer, kRequestTag});
      auto data = chunks({const_cast<std::byte*>(e.send_data.data()), e.send_data.size()},
                         options_.chunk_bytes, e.peer, kRequestData);
      sends.insert(sends.end(), data.begin(), data.end());
      receives.push_back(
          {int64_view(reinterpret_cast<std::int64_t*>(&answers[k]), 4), e.peer, kReplyTag});
      auto reply_data = chunks(e.recv_data, options_.chunk_bytes, e.peer, kReplyData);
      receives.insert(receives.end(), reply_data.begin(), reply_data.end());
    }
    channel_->send_recv(sends, receives);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: no answer from {} within the timeout ({} ms): {}",
                                   where(op, name), peers_text(peers), channel_->timeout().count(),
                                   e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: lost {} (failed or exited): {}", where(op, name),
                                   peers_text(peers), e.what()));
  }
  for (std::size_t k = 0; k < exchanges.size(); ++k) {
    check_answer(answers[k], *exchanges[k].request, exchanges[k].peer, op, name);
  }
  return answers;
}

WindowService::Reply WindowService::call(const Request& request, int peer,
                                         std::span<const std::byte> send_data,
                                         std::span<std::byte> recv_data, const std::string& op,
                                         const std::string& name) {
  const Exchange one{
      .peer = peer, .request = &request, .send_data = send_data, .recv_data = recv_data};
  return call_all(std::span<const Exchange>(&one, 1), op, name).front();
}

void WindowService::check_answer(const Reply& answer, const Request& request, int peer,
                                 const std::string& op, const std::string& name) const {
  switch (answer.status) {
    case kOk: return;
    case kNoWindow:
      throw InvalidArgument(fmt::format("{}: rank {} has no such window (created on every rank?)",
                                        where(op, name), peer));
    case kNoBuffer:
      throw InvalidArgument(
          fmt::format("{}: rank {} keeps no buffer for rank {} (not its in-neighbour when the "
                      "window was created)",
                      where(op, name), peer, rank_));
    case kWrongSize:
      throw InvalidArgument(fmt::format("{}: rank {}'s window holds another size than {} bytes",
                                        where(op, name), peer, request.nbytes));
    case kNotHolder:
      throw InvalidArgument(
          fmt::format("{}: rank {}'s mutex is not held by rank {}", where(op, name), peer, rank_));
    default:
      throw InternalError(fmt::format("{}: rank {} answered with unknown status {}",
                                      where(op, name), peer, answer.status));
  }
}

void WindowService::put(const std::string& name, const TensorView& data,
                        std::span<const WindowPeer> destinations, double self_weight,
                        bool accumulate, bool require_mutex, bool with_p) {
  const std::string op(op_name(accumulate ? kAccumulate : kPut));
  const std::lock_guard client(client_mutex_);
  const auto id = window_id(name);
  double p = 1.0;
  {
    const auto [w, lock] = lock_window(id);
    if (w == nullptr) throw InvalidArgument(fmt::format("{}: no such window", where(op, name)));
    BAGUA_CHECK_ARG(data.device.type == DeviceType::kCPU && data.dtype == w->tensor.dtype &&
                        data.numel == w->tensor.numel,
                    "{}: the tensor ({} elements of {}) differs from the window's ({} of {})",
                    where(op, name), data.numel, to_string(data.dtype), w->tensor.numel,
                    to_string(w->tensor.dtype));
    p = w->p;
  }
  std::vector<int> ranks;
  for (const auto& d : destinations) {
    BAGUA_CHECK_ARG(d.rank >= 0 && d.rank < size_ && d.rank != rank_,
                    "{}: destination {} is not another rank of the {}", where(op, name), d.rank,
                    size_);
    ranks.push_back(d.rank);
  }
  std::sort(ranks.begin(), ranks.end());
  if (require_mutex) {
    for (int r : ranks) lock_one(name, id, r);
  }
  try {
    // The weight is applied here, so the targets copy or add bytes: one
    // scaled copy per distinct weight, then every destination at once.
    std::map<double, std::vector<std::byte>> scaled;
    std::vector<Request> requests;
    requests.reserve(destinations.size());
    std::vector<Exchange> exchanges;
    for (const auto& d : destinations) {
      auto [copy, fresh] = scaled.try_emplace(d.weight, data.nbytes());
      if (fresh)
        scale_into(copy->second.data(), data.bytes(), data.numel, data.dtype, d.weight, false);
      requests.push_back({.op = accumulate ? kAccumulate : kPut,
                          .id = static_cast<std::int64_t>(id),
                          .source = rank_,
                          .weight = as_bits(d.weight),
                          .p = as_bits(d.weight * p),
                          .nbytes = static_cast<std::int64_t>(data.nbytes()),
                          .with_p = with_p ? 1 : 0});
      exchanges.push_back({.peer = d.rank,
                           .request = &requests.back(),
                           .send_data = copy->second,
                           .recv_data = {}});
    }
    call_all(exchanges, op, name);
  } catch (...) {
    if (require_mutex) {
      try {
        for (int r : ranks) unlock_one(name, id, r);
      } catch (const std::exception& e) {
        log().warn("{}: releasing the mutexes after a failure: {}", where(op, name), e.what());
      }
    }
    throw;
  }
  if (require_mutex) {
    for (int r : ranks) unlock_one(name, id, r);
  }
  // Under the window's lock, so a get never sees the tensor scaled and p
  // not yet (or the reverse).
  const auto [w, lock] = lock_window(id, false);
  scale_in_place(data, self_weight);
  if (with_p && w != nullptr) w->p *= self_weight;
}

void WindowService::get(const std::string& name, std::span<const WindowPeer> sources,
                        bool require_mutex, bool with_p) {
  const std::string op(op_name(kGet));
  const std::lock_guard client(client_mutex_);
  const auto id = window_id(name);
  std::size_t nbytes = 0;
  {
    const auto [w, lock] = lock_window(id);
    if (w == nullptr) throw InvalidArgument(fmt::format("{}: no such window", where(op, name)));
    for (const auto& s : sources) {
      BAGUA_CHECK_ARG(w->buffers.count(s.rank) != 0,
                      "{}: rank {} is not an in-neighbour of rank {} in this window",
                      where(op, name), s.rank, rank_);
    }
    nbytes = w->tensor.nbytes();
  }
  std::vector<int> ranks;
  for (const auto& s : sources) ranks.push_back(s.rank);
  std::sort(ranks.begin(), ranks.end());
  auto release = [&] {
    if (require_mutex) {
      for (int r : ranks) unlock_one(name, id, r);
    }
  };
  if (require_mutex) {
    for (int r : ranks) lock_one(name, id, r);
  }
  try {
    // Every source at once, each into a buffer of its own.
    const Request request{.op = kGet,
                          .id = static_cast<std::int64_t>(id),
                          .source = rank_,
                          .nbytes = static_cast<std::int64_t>(nbytes)};
    std::vector<std::vector<std::byte>> received(sources.size(), std::vector<std::byte>(nbytes));
    std::vector<Exchange> exchanges;
    for (std::size_t k = 0; k < sources.size(); ++k) {
      exchanges.push_back({.peer = sources[k].rank,
                           .request = &request,
                           .send_data = {},
                           .recv_data = received[k]});
    }
    const std::vector<Reply> answers = call_all(exchanges, op, name);
    const auto [w, lock] = lock_window(id);
    BAGUA_CHECK_INTERNAL(w != nullptr, "{}: the window vanished", where(op, name));
    for (std::size_t k = 0; k < sources.size(); ++k) {
      const auto& s = sources[k];
      scale_into(w->buffers.at(s.rank).data(), received[k].data(), w->tensor.numel, w->tensor.dtype,
                 s.weight, false);
      if (with_p) w->buffer_p[s.rank] = s.weight * as_double(answers[k].p);
      ++w->versions[s.rank];
    }
  } catch (...) {
    try {
      release();
    } catch (const std::exception& e) {
      log().warn("{}: releasing the mutexes after a failure: {}", where(op, name), e.what());
    }
    throw;
  }
  release();
}

void WindowService::update(const std::string& name, double self_weight,
                           std::span<const WindowPeer> neighbors, double divisor, bool reset,
                           const TensorView& out, bool require_mutex, bool with_p) {
  const std::string op = "win_update";
  const std::lock_guard client(client_mutex_);
  const auto id = window_id(name);
  if (require_mutex) lock_local(name, id);
  try {
    const auto [w, lock] = lock_window(id);
    if (w == nullptr) throw InvalidArgument(fmt::format("{}: no such window", where(op, name)));
    BAGUA_CHECK_ARG(out.numel == w->tensor.numel && out.dtype == w->tensor.dtype,
                    "{}: the output differs from the window's tensor", where(op, name));
    for (const auto& n : neighbors) {
      BAGUA_CHECK_ARG(w->buffers.count(n.rank) != 0,
                      "{}: rank {} is not an in-neighbour of rank {} in this window",
                      where(op, name), n.rank, rank_);
    }
    // Sum, then divide once (exact for the uniform average of equal values).
    if (out.data != w->tensor.data && out.nbytes() > 0) {
      std::memcpy(out.data, w->tensor.data, out.nbytes());
    }
    scale_in_place(out, self_weight);
    for (const auto& n : neighbors) {
      scale_into(out.bytes(), w->buffers.at(n.rank).data(), out.numel, out.dtype, n.weight, true);
    }
    if (divisor != 1.0) scale_in_place(out, 1.0 / divisor);
    if (with_p && out.data == w->tensor.data) {
      double p = self_weight * w->p;
      for (const auto& n : neighbors) p += n.weight * w->buffer_p.at(n.rank);
      w->p = p / divisor;
    }
    if (reset) {
      for (const auto& n : neighbors) {
        auto& buffer = w->buffers.at(n.rank);
        std::fill(buffer.begin(), buffer.end(), std::byte{0});
        if (with_p) w->buffer_p[n.rank] = 0.0;
      }
    }
    for (auto& [source, version] : w->versions) version = 0;
  } catch (...) {
    if (require_mutex) unlock_local(name, id);
    throw;
  }
  if (require_mutex) unlock_local(name, id);
}

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

// -- progress thread --------------------------------------------------------

void WindowService::serve() {
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) peers.push_back(r);
  }
  try {
    while (!stopping_) {
      Request request;
      const int sender = channel_->recv_any(
          int64_view(reinterpret_cast<std::int64_t*>(&request), 8), peers, kRequestTag,
          /*wait_forever=*/true);
      serve_one(request, sender);
    }
  } catch (const std::exception& e) {
    if (stopping_) return;
    const std::lock_guard lock(state_mutex_);
    failure_ = std::make_exception_ptr(BackendError(fmt::format(
        "window service on rank {}: its progress thread lost the channel (a peer failed or "
        "exited): {}",
        rank_, e.what())));
    failed_ = true;
    if (!windows_.empty()) log().error("window service on rank {} stops: {}", rank_, e.what());
    for (auto& [id, w] : windows_) {
      const std::lock_guard wake(w->mutex);  // a waiter between its check and its wait
      w->granted.notify_all();
    }
  }
}

void WindowService::serve_one(const Request& request, int sender) {
  BAGUA_CHECK_INTERNAL(request.source == sender,
                       "window service on rank {}: a request from rank {} claims rank {}", rank_,
                       sender, request.source);
  const auto id = static_cast<std::uint64_t>(request.id);
  switch (request.op) {
    case kPut:
    case kAccumulate: {
      // Receive first (the sender's chunks are posted), then apply under the
      // window's lock in one go: an update never sees half a put.
      std::vector<std::byte> data(static_cast<std::size_t>(request.nbytes));
      for (const auto& chunk : chunks(data, options_.chunk_bytes, sender, kRequestData)) {
        channel_->send_recv({}, std::span<const PeerMessage>(&chunk, 1));
      }
      Reply answer;
      {
        const auto [w, lock] = lock_window(id, false);
        if (w == nullptr) {
          answer.status = kNoWindow;
        } else if (w->buffers.count(sender) == 0) {
          answer.status = kNoBuffer;
        } else if (w->tensor.nbytes() != data.size()) {
          answer.status = kWrongSize;
        } else {
          auto& buffer = w->buffers.at(sender);
          if (request.op == kPut) {
            if (!data.empty()) std::memcpy(buffer.data(), data.data(), data.size());
            ++w->versions[sender];
            if (request.with_p) w->buffer_p[sender] = as_double(request.p);
          } else {
            scale_into(buffer.data(), data.data(), w->tensor.numel, w->tensor.dtype, 1.0, true);
            if (request.with_p) w->buffer_p[sender] += as_double(request.p);
          }
        }
      }
      reply(sender, answer);
      return;
    }
    case kGet: {
      Reply answer;
      std::vector<std::byte> data;
      {
        const auto [w, lock] = lock_window(id, false);
        if (w == nullptr) {
          answer.status = kNoWindow;
        } else if (w->tensor.nbytes() != static_cast<std::size_t>(request.nbytes)) {
          answer.status = kWrongSize;
        } else {
          data.assign(w->tensor.bytes(), w->tensor.bytes() + w->tensor.nbytes());
          answer.p = as_bits(w->p);
          answer.nbytes = request.nbytes;
        }
      }
      // The client posted receives for the bytes it asked for: an error
      // answer fills them too (with zeros it ignores), so none waits.
      if (answer.status != kOk) data.assign(static_cast<std::size_t>(request.nbytes), std::byte{0});
      reply(sender, answer, data);
      return;
    }
    case kLock: {
      bool now = true;
      Reply answer;
      {
        const auto [w, lock] = lock_window(id, false);
        if (w == nullptr) {
          answer.status = kNoWindow;  // answered at once, with the error
        } else {
          w->mutex_queue.push_back(sender);
          now = w->mutex_queue.front() == sender;
        }
      }
      if (now) reply(sender, answer);
      return;  // else the grant comes with the holder's release
    }
    case kUnlock: {
      Reply answer;
      int next = -1;
      {
        const auto [w, lock] = lock_window(id, false);
        if (w == nullptr) {
          answer.status = kNoWindow;
        } else if (w->mutex_queue.empty() || w->mutex_queue.front() != sender) {
          answer.status = kNotHolder;
        } else {
          w->mutex_queue.pop_front();
          if (!w->mutex_queue.empty()) next = w->mutex_queue.front();
          if (next == rank_) w->granted.notify_all();  // this rank's own lock_local waits
        }
      }
      reply(sender, answer);
      if (next >= 0 && next != rank_) reply(next, Reply{});
      return;
    }
    default:
      throw InternalError(fmt::format("window service on rank {}: unknown op {} from rank {}",
                                      rank_, request.op, sender));
  }
}

void WindowService::reply(int peer, const Reply& message, std::span<const std::byte> data) {
  const std::lock_guard lock(reply_mutex_);
  Reply copy = message;
  const PeerMessage header[] = {
      {int64_view(reinterpret_cast<std::int64_t*>(&copy), 4), peer, kReplyTag}};
  channel_->send_recv(header, {});
  std::span<std::byte> bytes{const_cast<std::byte*>(data.data()), data.size()};
  for (const auto& chunk : chunks(bytes, options_.chunk_bytes, peer, kReplyData)) {
    channel_->send_recv(std::span<const PeerMessage>(&chunk, 1), {});
  }
}

}  // namespace bagua
