// The window service's progress thread: it receives peers' requests on the
// service channel and answers them (put, accumulate, get, lock, unlock).
#include "bagua/runtime/window_service.h"

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "runtime/window_protocol.h"

namespace bagua {

using namespace window_protocol;

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
