// One-sided windows (BlueFog's win_* calls, design/bluefog.md section 9):
// every rank registers a tensor under a name and keeps one buffer per
// in-neighbour; a rank writes into (put, accumulate) or reads from (get)
// another rank's window without that rank calling anything.
//
// Passive target needs a party that answers while the target computes, so
// each process runs one progress thread (C++, no GIL) on a communicator of
// its own. It waits for request headers from any rank (recv_any), serves
// PUT / ACCUMULATE / GET / LOCK / UNLOCK, and acknowledges each; the calling
// side of an op (the "client": put, get, lock...) returns on the ack. A put
// or get to several peers sends to all of them at once, after posting every
// receive of their answers, so a progress thread never waits for a client
// that waits for another peer (call_all). Data
// travel in chunks of `chunk_bytes`, each on its own tag and each wait
// bounded by the timeout, so any size works and a long transfer of a large
// tensor never trips the timeout as a whole.
//
// Locks: each window's own mutex guards its buffers, versions, p, mutex
// queue and the writes to its tensor, between the progress thread and the
// caller's update (while the thread applies a put to one window, an update
// of another runs); `state_mutex_` guards the set of windows and is held to
// find one and lock it (so a lookup may wait while another thread waits for
// a busy window); `client_mutex_` makes the client side one op at a time (the
// reply tags carry no sequence, so one outstanding request per rank keeps
// replies unambiguous). Order: client_mutex_ -> state_mutex_ -> a window's
// mutex -> reply_mutex_ (replies sent by the progress thread and by a local
// unlock that grants a remote waiter). A window is erased (win_free) with
// state_mutex_ and its own mutex held, so whoever found it under its mutex
// finishes first.
//
// Distributed mutexes: one FIFO queue per (window, owner rank), served by
// the owner's progress thread. A LOCK that must wait gets its grant later as
// the reply, so the thread never blocks on a mutex. Several ranks are locked
// in ascending rank order, so two lockers never hold each other's.
//
// Every client wait is bounded by the communicator's timeout and its error
// names the rank, the op, the window and the peer. A progress thread that
// lost its channel records why; the next op on that rank raises it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bagua/comm/communicator.h"

namespace bagua {

// A rank and the weight an op applies for it.
struct WindowPeer {
  int rank = -1;
  double weight = 1.0;
};

struct WindowServiceOptions {
  // Bytes per data message; any tensor size is split into these.
  std::size_t chunk_bytes = std::size_t{1} << 20;
};

class WindowService {
 public:
  // Collective over `comm`: the service takes communicators of its own
  // (new_group), so window traffic never meets collectives or neighbour ops.
  explicit WindowService(Communicator& comm, WindowServiceOptions options = {});
  // Ends the progress thread (aborting its channel): noexcept, never waits
  // for peers.
  ~WindowService();
  WindowService(const WindowService&) = delete;
  WindowService& operator=(const WindowService&) = delete;

  // Collective. Registers `tensor` (live memory: the caller keeps it alive
  // and contiguous until free) with a buffer per rank of `sources` (the
  // in-neighbours), each a copy of `tensor` or zeros; versions 0; p = 1 at
  // self, 0 in the buffers. False on every rank if any rank already has
  // `name` (nothing created). float32 / float64 host tensors only. A rank
  // that found its arguments wrong passes why as `refusal`: every rank then
  // raises InvalidArgument naming it, none waits for that rank.
  bool create(const std::string& name, const TensorView& tensor, std::vector<int> sources,
              bool zero_init, std::string refusal = {});
  // Collective; an empty name frees every window. Every rank first finishes
  // its own ops, then a barrier: no request for a freed window is in flight.
  // False if some rank lacks `name` (then nothing is freed).
  bool free(const std::string& name);
  std::vector<std::string> names() const;  // sorted
  bool exists(const std::string& name) const;

  // For each d of `destinations`: the buffer for this rank at d :=
  // (accumulate: +=) weight * data, p likewise with this rank's p; a put
  // bumps the version there. Then data *= self_weight and p *= self_weight.
  // `require_mutex`: holds the destinations' mutexes around the transfer.
  // `with_p`: p takes part (BlueFog's associated p switch).
  void put(const std::string& name, const TensorView& data,
           std::span<const WindowPeer> destinations, double self_weight, bool accumulate,
           bool require_mutex, bool with_p);
  // For each s of `sources`: this rank's buffer for s := weight * (s's
  // registered tensor now), p too; its version +1.
  void get(const std::string& name, std::span<const WindowPeer> sources, bool require_mutex,
           bool with_p);
  // out := (self_weight * x + sum_j w_j * buffer_j) / divisor, x the
  // registered tensor; `out` may be x itself (then p combines the same way).
  // `reset` zeroes the named buffers (and their p) afterwards; every version
  // goes to 0. `require_mutex` holds this rank's own mutex.
  void update(const std::string& name, double self_weight, std::span<const WindowPeer> neighbors,
              double divisor, bool reset, const TensorView& out, bool require_mutex, bool with_p);
  std::map<int, std::int64_t> versions(const std::string& name) const;
  double associated_p(const std::string& name) const;
  // A copy of the buffer for `source` (tests and diagnostics).
  std::vector<std::byte> buffer(const std::string& name, int source) const;

  // The distributed mutexes of `ranks` (self allowed) for window `name`,
  // acquired in ascending order / released.
  void lock(const std::string& name, std::vector<int> ranks);
  void unlock(const std::string& name, std::vector<int> ranks);

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  struct Window {
    std::mutex mutex;                 // guards everything below
    std::condition_variable granted;  // this rank's own mutex changed hands
    std::string name;
    TensorView tensor;
    std::map<int, std::vector<std::byte>> buffers;  // by source rank
    std::map<int, std::int64_t> versions;
    std::map<int, double> buffer_p;
    double p = 1.0;
    std::deque<int> mutex_queue;  // front holds this rank's mutex of the window
  };
  struct Request;
  struct Reply;

  // Client side (under client_mutex_). One request to each of several
  // peers, sent at once: the peers serve them in parallel, and the call
  // returns when every one has answered (answers in the requests' order).
  struct Exchange {
    int peer = -1;
    const Request* request = nullptr;
    std::span<const std::byte> send_data;  // after the header, in chunks
    std::span<std::byte> recv_data;        // the reply's data (GET)
  };
  std::vector<Reply> call_all(std::span<const Exchange> exchanges, const std::string& op,
                              const std::string& name);
  Reply call(const Request& request, int peer, std::span<const std::byte> send_data,
             std::span<std::byte> recv_data, const std::string& op, const std::string& name);
  void check_answer(const Reply& answer, const Request& request, int peer, const std::string& op,
                    const std::string& name) const;
  void lock_one(const std::string& name, std::uint64_t id, int owner);
  void unlock_one(const std::string& name, std::uint64_t id, int owner);
  void lock_local(const std::string& name, std::uint64_t id);
  void unlock_local(const std::string& name, std::uint64_t id);

  // The allgather of create / free, its errors naming the op and window.
  void agree(const std::string& op, const std::string& name, const TensorView& mine,
             const TensorView& all);

  // Progress thread.
  void serve();
  void serve_one(const Request& request, int sender);
  void reply(int peer, const Reply& message, std::span<const std::byte> data = {});

  // A window found under state_mutex_ and returned with its own mutex held
  // (window nullptr, no lock, if absent). `check_failure`: first raise the
  // progress thread's failure, if any.
  struct Locked {
    Window* window = nullptr;
    std::unique_lock<std::mutex> lock;
  };
  Locked lock_window(std::uint64_t id, bool check_failure = true) const;
  Window* find(std::uint64_t id) const;  // under state_mutex_
  void rethrow_if_failed() const;        // under state_mutex_
  std::string where(const std::string& op, const std::string& name) const;

  WindowServiceOptions options_;
  int rank_;
  int size_;
  std::unique_ptr<Communicator> channel_;      // requests, data and replies
  std::unique_ptr<Communicator> collectives_;  // create / free agreement

  mutable std::mutex client_mutex_;
  mutable std::mutex state_mutex_;
  std::mutex reply_mutex_;
  std::map<std::uint64_t, std::unique_ptr<Window>> windows_;
  std::exception_ptr failure_;
  std::atomic<bool> failed_{false};  // failure_ is set (read without state_mutex_)
  std::atomic<bool> stopping_{false};
  std::thread server_;
};

// The 64-bit id of a window name (FNV-1a): what requests carry.
std::uint64_t window_id(const std::string& name);

}  // namespace bagua
