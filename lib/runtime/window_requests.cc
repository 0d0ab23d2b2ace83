// The window service's client side: put, accumulate, get and update, and
// the request / reply exchange they share (see bagua/runtime/window_service.h).
#include "bagua/runtime/window_service.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "runtime/window_protocol.h"

namespace bagua {

using namespace window_protocol;

namespace {

// "rank 3" or "ranks 1, 2" (of a call to several peers, where the failing
// one is not known).
std::string peers_text(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "one of ranks", fmt::join(ranks, ", "));
}

}  // namespace

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

}  // namespace bagua
