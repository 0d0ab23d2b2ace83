// The Gloo backend: CPU tensors over Gloo's TCP transport.
//
// One Gloo context per communicator; collectives are Gloo's option-struct
// free functions, with reductions supplied by bagua/core/elementwise.h so
// fp16/bf16 and every ReduceOp share one implementation. Point-to-point
// messages use Gloo's unbound buffers on slots of their own (kP2PSlotBase),
// numbered per peer so sends and receives match in program order. How the
// ranks find each other (store adapter, TCP device, address check) is in
// gloo_rendezvous.cc.
#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/shared_memory_messages.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string_view>
#include <utility>

#include <fmt/ranges.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/scatter.h>
#include <gloo/transport/unbound_buffer.h>

#include "bagua/core/elementwise.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "comm/gloo_rendezvous.h"

namespace bagua {
namespace {

constexpr std::uint64_t kP2PSlotBase = 0xB7ULL << 56;
constexpr std::uint64_t kTaggedSlotBase = 0xB8ULL << 56;
constexpr std::uint64_t kTagMask = (1ULL << 56) - 1;
// Never sent on: lost_peers() posts an empty receive on it, which first
// rethrows the connection's error if it has one.
constexpr std::uint64_t kProbeSlot = 0xB9ULL << 56;

bool looks_like_timeout(std::string_view message) {
  return message.find("Timed out") != std::string_view::npos ||
         message.find("timed out") != std::string_view::npos ||
         message.find("timeout") != std::string_view::npos;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<Store> store, int rank, int size, GlooOptions options)
      : store_(std::move(store)), options_(std::move(options)), rank_(rank), size_(size) {
    if (options_.timeout.count() <= 0) options_.timeout = env().comm_timeout;
    shm_options_ = options_.shared_memory.value_or(
        SharedMemoryOptions{env().shared_memory, env().shared_memory_min_bytes, 0});
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(options_.timeout);
    auto prefixed = make_prefix_store(options_.prefix, store_);
    GlooStoreAdapter adapter(*prefixed, options_.timeout);
    auto device = listening_device(options_, rank, size);
    if (size > 1) check_gloo_addresses(*prefixed, options_, rank, size);
    run("connect", [&] { context->connectFullMesh(adapter, device); });
    context_ = std::move(context);
    // connectFullMesh can return on one rank while a peer still completes its
    // side of their pair; a rank that then finished early and closed the
    // context would fail the peer's connect. Leave only when all are connected.
    barrier();
    send_sequence_.assign(static_cast<std::size_t>(size), 0);
    recv_sequence_.assign(static_cast<std::size_t>(size), 0);
    attach_mailboxes();
    log().debug("gloo communicator '{}' ready: rank {} of {}", options_.prefix, rank, size);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override {
    return fmt::format("gloo {}.{}.{}", GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH);
  }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  std::size_t host_message_capacity() const override {
    return mailboxes_ ? mailboxes_->capacity() : 0;
  }

  void abort() noexcept override {
    aborted_.store(true);
    const std::lock_guard lock(any_mutex_);
    for (auto* waiting : waiting_any_) waiting->abortWaitRecv();
  }

  std::vector<int> lost_peers() override {
    std::vector<int> lost;
    if (!context_ || size_ == 1) return lost;
    // A connection in error rethrows its error before posting anything. On a
    // healthy one the empty receive stays posted, on a slot nobody sends to,
    // until the buffer dies: a few bytes of bookkeeping per call, and calls
    // come only after a failure or from a watchdog.
    auto probe = context_->createUnboundBuffer(nullptr, 0);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      try {
        probe->recv(r, kProbeSlot, 0, 0);
      } catch (const ::gloo::Exception& e) {
        if (!looks_like_timeout(e.what())) lost.push_back(r);
      }
    }
    return lost;
  }

 protected:
  void do_allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    copy_if_distinct(send, recv);
    // The bytes a ring exchanges, whichever transport carries them.
    count(recv.nbytes() * 2 * (size() - 1) / size());
    if (on_shared_memory("allreduce", recv, [&](SharedMemoryGroup& shm) {
          shm.allreduce(recv, op, options_.timeout, aborted_);
        })) {
      return;
    }
    if (size() > 1) {
      collective<::gloo::AllreduceOptions>("allreduce", ::gloo::allreduce, [&](auto& opts) {
        set_typed_output(opts, recv);
        opts.setReduceFunction(reduce_function(op, recv.dtype));
      });
    }
    if (op == ReduceOp::kAvg) divide_inplace(recv, size());
  }

  void do_reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) override {
    const bool is_root = rank() == root;
    if (is_root) copy_if_distinct(send, recv);
    count(send.nbytes());
    // Gloo reduces in place in the output buffer; non-roots use a scratch copy
    // so their input is left untouched.
    std::vector<std::byte> scratch;
    TensorView work = recv;
    if (!is_root) {
      scratch.assign(send.bytes(), send.bytes() + send.nbytes());
      work = TensorView{scratch.data(), send.numel, send.dtype, send.device};
    }
    if (size() > 1) {
      collective<::gloo::ReduceOptions>("reduce", ::gloo::reduce, [&](auto& opts) {
        opts.setRoot(root);
        set_typed_output(opts, work);
        opts.setReduceFunction(reduce_function(op, work.dtype));
      });
    }
    if (is_root && op == ReduceOp::kAvg) divide_inplace(recv, size());
  }

  void do_broadcast(const TensorView& buffer, int root) override {
    if (size() == 1) return;
    count(buffer.nbytes());
    if (on_shared_memory("broadcast", buffer, [&](SharedMemoryGroup& shm) {
          shm.broadcast(buffer, root, options_.timeout, aborted_);
        })) {
      return;
    }
    collective<::gloo::BroadcastOptions>("broadcast", ::gloo::broadcast, [&](auto& opts) {
      opts.setRoot(root);
      opts.setOutput(buffer.bytes(), buffer.nbytes());
    });
  }

  void do_allgather(const TensorView& send, const TensorView& recv) override {
    if (size() == 1) return copy_if_distinct(send, recv);
    count(send.nbytes() * (size() - 1));
    if (on_shared_memory("allgather", send, [&](SharedMemoryGroup& shm) {
          shm.allgather(send, recv, options_.timeout, aborted_);
        })) {
      return;
    }
    // The bytes of Gloo's ring (n - 1 chunks out per rank) in one round. An
    // input that aliases its own slot of the output is only read.
    const std::size_t chunk = send.nbytes();
    exchange_with_every_peer(
        "allgather", send.bytes(), chunk, [](int) { return std::size_t{0}; }, recv, chunk);
    const std::size_t own = static_cast<std::size_t>(rank_) * chunk;
    if (send.bytes() != recv.bytes() + own) std::memcpy(recv.bytes() + own, send.bytes(), chunk);
  }

  void do_gather(const TensorView& send, const TensorView& recv, int root) override {
    if (size() == 1) return copy_if_distinct(send, recv);
    count(send.nbytes());
    collective<::gloo::GatherOptions>("gather", ::gloo::gather, [&](auto& opts) {
      opts.setRoot(root);
      opts.setInput(send.bytes(), send.nbytes());
      if (rank() == root) opts.setOutput(recv.bytes(), recv.nbytes());
    });
  }

  void do_scatter(const TensorView& send, const TensorView& recv, int root) override {
    if (size() == 1) return copy_if_distinct(send, recv);
    count(recv.nbytes());
    collective<::gloo::ScatterOptions>("scatter", ::gloo::scatter, [&](auto& opts) {
      opts.setRoot(root);
      if (rank() == root) {
        std::vector<std::byte*> chunks;
        chunks.reserve(static_cast<std::size_t>(size()));
        for (int r = 0; r < size(); ++r) chunks.push_back(send.bytes() + r * recv.nbytes());
        opts.setInputs(chunks, recv.nbytes());
      }
      opts.setOutput(recv.bytes(), recv.nbytes());
    });
  }

  void do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    // Scatter-reduce: every rank receives the n copies of its own chunk with
    // one alltoall, then reduces them locally. (n-1)/n of the buffer moves.
    std::vector<std::byte> gathered(send.nbytes());
    TensorView copies{gathered.data(), send.numel, send.dtype, send.device};
    alltoall(send, copies);
    copy_if_distinct(copies.slice(0, recv.numel), recv);
    for (int r = 1; r < size(); ++r) {
      reduce_into(op, recv, recv, copies.slice(r * recv.numel, recv.numel));
    }
    if (op == ReduceOp::kAvg) divide_inplace(recv, size());
  }

  void do_alltoall(const TensorView& send, const TensorView& recv) override {
    if (size() == 1) return copy_if_distinct(send, recv);
    count(send.nbytes() * (size() - 1) / size());
    if (on_shared_memory("alltoall", send, [&](SharedMemoryGroup& shm) {
          shm.alltoall(send, recv, options_.timeout, aborted_);
        })) {
      return;
    }
    const std::size_t chunk = send.nbytes() / static_cast<std::size_t>(size());
    std::vector<std::byte> in_place_copy;  // in place, a chunk could arrive before its own left
    std::byte* outgoing = send.bytes();
    if (send.data == recv.data) {
      in_place_copy.assign(send.bytes(), send.bytes() + send.nbytes());
      outgoing = in_place_copy.data();
    }
    exchange_with_every_peer(
        "alltoall", outgoing, send.nbytes(),
        [chunk](int peer) { return static_cast<std::size_t>(peer) * chunk; }, recv, chunk);
    const std::size_t own = static_cast<std::size_t>(rank_) * chunk;
    if (outgoing != recv.bytes()) std::memcpy(recv.bytes() + own, outgoing + own, chunk);
  }

  void do_send_recv(std::span<const PeerMessage> sends,
                    std::span<const PeerMessage> receives) override {
    run("send_recv", [&] {
      std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> posted_sends;
      std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> posted_receives;
      for (const auto& message : receives) {
        if (message.buffer.numel == 0) continue;
        auto unbound = context_->createUnboundBuffer(message.buffer.data, message.buffer.nbytes());
        unbound->recv(message.peer, slot_of(message, recv_sequence_));
        posted_receives.push_back(std::move(unbound));
      }
      for (const auto& message : sends) {
        if (message.buffer.numel == 0) continue;
        count(message.buffer.nbytes());
        auto unbound = context_->createUnboundBuffer(message.buffer.data, message.buffer.nbytes());
        unbound->send(message.peer, slot_of(message, send_sequence_));
        posted_sends.push_back(std::move(unbound));
      }
      for (auto& unbound : posted_sends) unbound->waitSend(options_.timeout);
      for (auto& unbound : posted_receives) unbound->waitRecv(options_.timeout);
    });
  }

  int do_recv_any(const TensorView& buffer, std::span<const int> peers, std::uint64_t tag,
                  bool wait_forever) override {
    return receive_tagged("recv_any", buffer, wait_forever, [&](auto& unbound) {
      unbound.recv(std::vector<int>(peers.begin(), peers.end()),
                   kTaggedSlotBase | (tag & kTagMask));
    });
  }

  void do_recv_from(const TensorView& buffer, int peer, std::uint64_t tag,
                    bool wait_forever) override {
    receive_tagged("recv_from", buffer, wait_forever,
                   [&](auto& unbound) { unbound.recv(peer, kTaggedSlotBase | (tag & kTagMask)); });
  }

  bool do_send_recv_on_host(std::span<const PeerMessage> sends,
                            std::span<const PeerMessage> receives) override {
    if (!mailboxes_) return false;
    const auto fits = [&](const PeerMessage& m) {
      return m.buffer.nbytes() <= mailboxes_->capacity();
    };
    if (!std::all_of(sends.begin(), sends.end(), fits) ||
        !std::all_of(receives.begin(), receives.end(), fits)) {
      return false;
    }
    if (aborted_.load()) {
      throw BackendError(
          fmt::format("send_recv on rank {} of {} (group '{}'): the communicator "
                      "was aborted",
                      rank(), size(), options_.prefix));
    }
    for (const auto& message : sends) {
      if (message.buffer.numel > 0) count(message.buffer.nbytes());
    }
    try {
      mailboxes_->exchange(sends, receives, options_.timeout, aborted_);
    } catch (const InvalidArgument&) {
      throw;  // nothing was sent
    } catch (const TimeoutError& e) {
      aborted_.store(true);  // messages may be left in mailboxes: later ones would mismatch
      throw TimeoutError(e.what() + lost_connections());
    } catch (const BackendError& e) {
      aborted_.store(true);
      throw BackendError(e.what() + lost_connections());
    }
    return true;
  }

  void do_barrier() override {
    if (size() == 1) return;
    collective<::gloo::BarrierOptions>("barrier", ::gloo::barrier, [](auto& /*opts*/) {});
  }

  std::unique_ptr<Communicator> do_new_group(std::span<const int> ranks) override {
    const GroupSlot group = next_group(ranks);
    if (group.rank < 0) return nullptr;
    GlooOptions child = options_;
    child.prefix = fmt::format("{}/group{}", options_.prefix, group.number);
    return std::make_unique<GlooCommunicator>(store_, group.rank, static_cast<int>(ranks.size()),
                                              child);
  }

 private:
  // The P-Reduce's mailboxes, set up with the communicator so that every
  // rank decides alike, from the start, whether its messages take them. The
  // setup's allgathers stay on the network (they must not set up the
  // collectives' segment) and are not traffic of the caller.
  void attach_mailboxes() {
    if (size() == 1 || !shm_options_.enabled) return;
    const std::int64_t sent = counters_.bytes_sent, received = counters_.bytes_received,
                       calls = counters_.calls;
    shm_options_.enabled = false;
    try {
      mailboxes_ = SharedMemoryMessages::attach(*this, options_.prefix);
    } catch (...) {
      shm_options_.enabled = true;
      throw;
    }
    shm_options_.enabled = true;
    counters_.bytes_sent = sent;
    counters_.bytes_received = received;
    counters_.calls = calls;
  }

  // The shared-memory group when this call may use it. All ranks decide
  // alike (same size, same options); the first eligible call sets it up,
  // collectively.
  SharedMemoryGroup* shared_memory_for(const char* op, const TensorView& buffer) {
    if (size() == 1 || !shm_options_.enabled ||
        static_cast<std::int64_t>(buffer.nbytes()) < shm_options_.min_bytes) {
      return nullptr;
    }
    if (!shm_attached_) {
      shm_attached_ = true;
      // The setup's three small allgathers are not traffic of the caller's op.
      const std::int64_t sent = counters_.bytes_sent, received = counters_.bytes_received,
                         calls = counters_.calls;
      // A failure names the caller's op: the user called it, not the
      // setup's allgathers.
      const auto setting_up = [&](const Error& e) {
        return fmt::format("{} on rank {} of {} (group '{}'): setting up shared memory: {}", op,
                           rank(), size(), options_.prefix, e.what());
      };
      try {
        shm_ = SharedMemoryGroup::attach(*this, shm_options_, options_.prefix);
      } catch (const TimeoutError& e) {
        throw TimeoutError(setting_up(e));
      } catch (const BackendError& e) {
        throw BackendError(setting_up(e));
      }
      counters_.bytes_sent = sent;
      counters_.bytes_received = received;
      counters_.calls = calls;
    }
    return shm_.get();
  }

  // Runs `fn` on the shared-memory group and returns true when this call
  // may use it (`buffer`: what decides, the same size on every rank).
  template <typename Fn>
  bool on_shared_memory(const char* op, const TensorView& buffer, Fn&& fn) {
    SharedMemoryGroup* shm = shared_memory_for(op, buffer);
    if (shm == nullptr) return false;
    if (aborted_.load()) {
      throw BackendError(
          fmt::format("collective on rank {} of {} (group '{}'): the communicator "
                      "was aborted",
                      rank(), size(), options_.prefix));
    }
    try {
      fn(*shm);
    } catch (...) {
      aborted_.store(true);  // peers are mid-protocol: the segment's state is lost
      throw;
    }
    return true;
  }

  // Runs one Gloo call, translating its failures into our error types with
  // the op, rank and group named.
  // One tagged message into `buffer`, the receive posted by `post`; returns
  // the sender. abort() from another thread ends the wait.
  template <typename Post>
  int receive_tagged(std::string_view op, const TensorView& buffer, bool wait_forever,
                     Post&& post) {
    int sender = -1;
    run(op, [&] {
      auto unbound = context_->createUnboundBuffer(buffer.data, buffer.nbytes());
      post(*unbound);
      {
        const std::lock_guard lock(any_mutex_);
        if (aborted_.load()) return;
        waiting_any_.push_back(unbound.get());
      }
      // However the wait ends (an error included), abort() must no longer
      // reach the buffer, which dies with this scope.
      struct Unregister {
        GlooCommunicator& self;
        ::gloo::transport::UnboundBuffer* buffer;
        ~Unregister() {
          const std::lock_guard lock(self.any_mutex_);
          std::erase(self.waiting_any_, buffer);
        }
      } unregister{*this, unbound.get()};
      // An expired wait poisons the whole Gloo context, so "forever" is a
      // year, ended early by a message, an error or abortWaitRecv.
      constexpr auto kForever = std::chrono::hours(24 * 365);
      const bool received = unbound->waitRecv(
          &sender, wait_forever ? std::chrono::milliseconds(kForever) : options_.timeout);
      if (!received) sender = -1;
    });
    if (sender < 0) {
      throw BackendError(
          fmt::format("{} on rank {} of {}: the communicator was aborted", op, rank_, size_));
    }
    count(buffer.nbytes());
    return sender;
  }

  // One round with every peer at once: a receive of `chunk` bytes from each
  // peer into its slot of `recv` and a send to each of the `chunk` bytes at
  // `out_offset(peer)` of `outgoing`, all posted before any is waited for.
  // Gloo's alltoall and ring allgather took 2x and 1.3-1.5x their bytes'
  // time on a shaped link (2 ranks, 100 Mbit/s); this takes their bytes'.
  template <typename Offset>
  void exchange_with_every_peer(std::string_view op, std::byte* outgoing,
                                std::size_t outgoing_bytes, Offset&& out_offset,
                                const TensorView& recv, std::size_t chunk) {
    run(op, [&] {
      auto out = context_->createUnboundBuffer(outgoing, outgoing_bytes);
      auto in = context_->createUnboundBuffer(recv.data, recv.nbytes());
      for (int peer = 0; peer < size(); ++peer) {
        if (peer != rank_) {
          in->recv(peer, next_slot(recv_sequence_, peer), static_cast<std::size_t>(peer) * chunk,
                   chunk);
        }
      }
      for (int peer = 0; peer < size(); ++peer) {
        if (peer != rank_)
          out->send(peer, next_slot(send_sequence_, peer), out_offset(peer), chunk);
      }
      for (int peer = 1; peer < size(); ++peer) out->waitSend(options_.timeout);
      for (int peer = 1; peer < size(); ++peer) in->waitRecv(options_.timeout);
    });
  }

  template <typename Fn>
  void run(std::string_view op, Fn&& fn) {
    if (aborted_.load()) {
      throw BackendError(
          fmt::format("{} on rank {} of {}: the communicator was aborted", op, rank_, size_));
    }
    try {
      fn();
    } catch (const ::gloo::Exception& e) {
      const std::string where =
          fmt::format("{} on rank {} of {} (group '{}', {}, timeout {} ms)", op, rank_, size_,
                      options_.prefix, backend_name(), options_.timeout.count());
      // Gloo names a failed connection by its address, and a wait that timed
      // out by nothing: say which ranks' connections are gone (a peer that
      // died makes the others wait on each other until the timeout).
      const std::string gone = lost_connections();
      if (looks_like_timeout(e.what())) {
        throw TimeoutError(fmt::format("{} timed out: {}{}", where, e.what(), gone));
      }
      throw BackendError(fmt::format("{} failed: {}{}", where, e.what(), gone));
    }
  }

  // " [connection lost to rank 2, rank 3]", or "" when every connection is
  // healthy: appended to errors, so that a rank that waited on a survivor
  // also names the rank that died first.
  std::string lost_connections() {
    const auto lost = lost_peers();
    return lost.empty() ? std::string()
                        : fmt::format(" [connection lost to rank {}]", fmt::join(lost, ", rank "));
  }

  // Runs the Gloo collective `call` (run's error translation) with options
  // of this context and the next tag, after `fill` set its buffers.
  template <typename Options, typename Call, typename Fill>
  void collective(std::string_view op, Call&& call, Fill&& fill) {
    run(op, [&] {
      Options opts(context_);
      opts.setTag(tag_++);
      fill(opts);
      call(opts);
    });
  }

  // Point-to-point messages to (from) `peer` use consecutive slots, so sends
  // and receives match in program order.
  static std::uint64_t next_slot(std::vector<std::uint64_t>& sequence, int peer) {
    return kP2PSlotBase + sequence[static_cast<std::size_t>(peer)]++;
  }
  // Tagged messages match by tag alone, on slots of their own.
  static std::uint64_t slot_of(const PeerMessage& message, std::vector<std::uint64_t>& sequence) {
    if (message.tag == 0) return next_slot(sequence, message.peer);
    return kTaggedSlotBase | (message.tag & kTagMask);
  }
  static void copy_if_distinct(const TensorView& from, const TensorView& to) {
    if (from.data != to.data && from.nbytes() > 0) std::memcpy(to.data, from.data, from.nbytes());
  }

  static ::gloo::AllreduceOptions::Func reduce_function(ReduceOp op, DType dtype) {
    return dispatch_dtype(dtype, [op](auto tag) -> ::gloo::AllreduceOptions::Func {
      using T = decltype(tag);
      return [op](void* out, const void* a, const void* b, std::size_t n) {
        reduce_elements<T>(op, static_cast<T*>(out), static_cast<const T*>(a),
                           static_cast<const T*>(b), n);
      };
    });
  }

  // Reductions need the element type: Gloo passes the reduce function a count
  // of elements and never splits one element across two segments.
  template <typename Options>
  static void set_typed_output(Options& opts, const TensorView& view) {
    dispatch_dtype(view.dtype, [&](auto tag) {
      using T = decltype(tag);
      opts.setOutput(view.data_as<T>(), static_cast<std::size_t>(view.numel));
    });
  }

  std::shared_ptr<Store> store_;
  GlooOptions options_;
  int rank_;
  int size_;
  std::shared_ptr<::gloo::Context> context_;
  std::uint32_t tag_ = 0;
  int group_counter_ = 0;
  std::vector<std::uint64_t> send_sequence_;
  std::vector<std::uint64_t> recv_sequence_;
  std::atomic<bool> aborted_{false};
  // The pending recv_any calls (one per thread), so that abort() from
  // another thread can end them.
  std::mutex any_mutex_;
  std::vector<::gloo::transport::UnboundBuffer*> waiting_any_;
  SharedMemoryOptions shm_options_;
  bool shm_attached_ = false;
  std::unique_ptr<SharedMemoryGroup> shm_;
  std::unique_ptr<SharedMemoryMessages> mailboxes_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(std::shared_ptr<Store> store, int rank,
                                                     int size, GlooOptions options) {
  BAGUA_CHECK_ARG(store != nullptr, "make_gloo_communicator: store is null");
  BAGUA_CHECK_ARG(size >= 1 && rank >= 0 && rank < size,
                  "make_gloo_communicator: rank {} / size {} is not a valid rank", rank, size);
  return std::make_unique<GlooCommunicator>(std::move(store), rank, size, std::move(options));
}

}  // namespace bagua
