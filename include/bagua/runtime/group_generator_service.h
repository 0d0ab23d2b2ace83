// Ripples' group generator as a service: one rank (the host) runs the
// GroupGeneratorEngine and answers every rank's requests, so that all
// members of a group learn the same group (design/ripples.md, 4.3).
//
// The host serves from C++ threads, one per client rank, over a control
// communicator of its own: each thread keeps a receive from its rank posted,
// so a request leaves the client at once and its answer comes back in one
// more message. No Python and no GIL on the service path, so a busy training
// loop on the host does not delay the others. The host's own calls are
// queued too and served by a thread of the service in order, as the
// clients' messages are: the host does not reach the engine ahead of the
// others' requests already on their way (it would otherwise find them busy,
// take a group alone and run ahead of them). Each client's REQUEST carries
// how long its previous request took; the host's own requests are held back
// that long on average (a running mean over the clients' reports), so every
// rank pays about the same for its groups.
//
// Protocol (fixed-size messages of int64: kind, rank, group id, member count,
// the longest group buffer so far, members): a client sends REQUEST and
// waits for GROUP, DONE or FAILED; COMPLETE, LEAVE and LINGER need no
// answer; CLOSE is answered by CLOSED once the host processed it. Every wait
// of a client is bounded by the communicator's timeout. The host's threads
// end when every rank closed; the host's own close() returns only then, so a
// host that finishes training first never strands the rest.
//
// Failures: a client whose connection to the host closes (its process died
// or exited) is named at once; a rank that holds a group and stays silent
// for the timeout is named then (alive but stuck, or dead without closing).
// From then on the host's calls raise and every client's request (and any
// request waiting for a grant) is answered FAILED, naming the rank and the
// group it held, so every rank learns of it at its next request.
// A lingering rank (linger()) waits for the others to choose it; one that
// has waited half the timeout without being chosen (the others went quiet,
// e.g. to evaluate) is made to leave, so no wait runs into the timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/runtime/group_generator.h"

namespace bagua {

// One group this rank executed, for history(): steady-clock seconds
// (CLOCK_MONOTONIC, Python's time.monotonic()).
struct ExecutedGroup {
  Group group;
  double t_start = 0;  // when acquire() returned it
  double t_end = 0;    // when complete() was called
};

class GroupGeneratorService {
 public:
  // Collective over `comm`: every rank passes the same options and host.
  GroupGeneratorService(Communicator& comm, GroupGeneratorOptions options, int host_rank = 0);
  // Aborts the control channel if close() did not run (an exception
  // unwinding the training loop): the others then fail within their timeout.
  ~GroupGeneratorService();
  GroupGeneratorService(const GroupGeneratorService&) = delete;
  GroupGeneratorService& operator=(const GroupGeneratorService&) = delete;

  // Blocks until this rank's next group can run (the random mode waits for
  // its members to be free); nullopt once the rank left and has no group
  // left to drain. Then run the group and call complete(id).
  std::optional<Group> acquire();
  void complete(std::uint64_t group_id);
  // This rank stops training: it is never put in a new group; acquire()
  // still returns the groups already assigned to it, then nullopt.
  void leave();
  // This rank stops training but stays available (the engine's linger):
  // acquire() returns the groups the others' requests give it, then nullopt
  // once every rank lingers or left (or after half the timeout unchosen).
  void linger();
  // After leave() or linger(), and draining. The host returns once every rank closed.
  void close();
  // Once acquire() returned nullopt after linger(): the engine's
  // final_round_id() (every rank lingered to the end, so every rank got the
  // same id), else nullopt. Read on the thread that calls acquire().
  std::optional<std::uint64_t> final_round_id() const { return final_round_id_; }

  int rank() const { return rank_; }
  int host_rank() const { return host_; }
  bool is_host() const { return rank_ == host_; }
  const GroupGeneratorOptions& options() const { return options_; }
  // Engine statistics: host only (elsewhere InvalidArgument).
  GroupGeneratorStats engine_stats() const;
  // The longest group buffer any rank had, as of this rank's last group
  // (every reply carries the engine's figure): on every rank.
  std::int64_t max_buffer_len() const;
  // This rank's groups, oldest first (the last kHistoryLimit), and the
  // latency of its acquire() calls in milliseconds.
  std::vector<ExecutedGroup> history() const;
  std::vector<double> acquire_latencies_ms() const;

  static constexpr std::size_t kHistoryLimit = 100000;

 private:
  struct Delivery {
    int rank = -1;
    std::vector<std::int64_t> message;
    bool failed = false;  // a FAILED answer: the rank counts as told once it is sent
  };

  // Client side.
  std::vector<std::int64_t> ask(std::int64_t kind, std::int64_t group_id, bool expect_reply);
  [[noreturn]] void raise_failed(const std::vector<std::int64_t>& message) const;
  // A message that needs no answer (COMPLETE, LEAVE, LINGER): sent to the
  // host, or on the host queued for serve_host.
  void announce(std::int64_t kind, std::int64_t group_id);
  void record_acquired(const Group& group, std::chrono::steady_clock::time_point asked);

  // Host side (under mutex_ unless noted).
  std::vector<Delivery> handle(int sender, const std::vector<std::int64_t>& message);
  std::vector<Delivery> handle_after_failure(int sender, const std::vector<std::int64_t>& message);
  std::vector<Delivery> wake_waiters();
  std::vector<Delivery> deliver(int rank, const GroupReply& reply);
  Delivery answer(int rank, std::vector<std::int64_t> message);   // clears awaiting_[rank]
  void send_deliveries(const std::vector<Delivery>& deliveries);  // without mutex_
  void serve_rank(int rank);  // a receiving thread: rank's messages, in order
  void serve_host();          // the host's own calls (inbox_), in order
  // Without mutex_: `rank`'s connection failed (`what`): the host fails
  // naming it (unless it already failed, or `rank` had closed).
  void connection_lost(int rank, const std::string& what);
  // The host fails: `ranks` are lost, `reason` says how; returns the FAILED
  // answers to the ranks waiting for one.
  std::vector<Delivery> fail(std::vector<int> ranks, const std::string& reason);
  std::string groups_held(const std::vector<int>& ranks) const;
  // The destructor, after a failure: keeps answering FAILED for a moment,
  // until every client was told or closed, so that the ranks that ask next
  // learn which rank failed rather than only that the host went away.
  void tell_clients_before_leaving();
  // The watchdog thread: a rank that holds a group (others will wait for
  // it) and has not contacted the host for the communicator's timeout is
  // presumed dead or stuck; the host fails, naming it.
  void watch();
  std::vector<Delivery> check_silent_ranks();  // under mutex_
  // Lingering ranks waiting for half the timeout leave; returns their replies.
  std::vector<Delivery> release_idle_lingerers();  // under mutex_
  void rethrow_if_failed() const;
  bool all_closed() const;

  std::vector<std::int64_t> encode(std::int64_t kind, std::int64_t group_id,
                                   const std::vector<int>& ranks = {}) const;
  Group decode_group(const std::vector<std::int64_t>& message) const;

  GroupGeneratorOptions options_;
  int rank_;
  int host_;
  std::unique_ptr<Communicator> control_;
  std::size_t message_len_;

  // Host state.
  std::optional<GroupGeneratorEngine> engine_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<bool> closed_;
  std::optional<GroupReply> local_reply_;  // a granted group for the host's own waiting acquire
  std::exception_ptr failure_;
  std::vector<int> lost_;         // after a failure: the ranks named
  std::uint64_t lost_group_ = 0;  // and the group the first of them held (0: none)
  std::vector<bool> awaiting_;    // per rank: a REQUEST or CLOSE not answered yet
  std::vector<bool> told_;        // per rank: its FAILED answer was sent
  std::mutex send_mutex_;
  std::vector<std::thread> receivers_;  // serve_rank, one per client rank
  struct Posted {
    std::chrono::steady_clock::time_point at;
    std::vector<std::int64_t> message;
  };
  std::deque<Posted> inbox_;  // the host's own messages
  // The clients' request round trips, a running mean over their reports
  // (each REQUEST carries its sender's previous one), at most 20 ms: how long
  // the host's own requests are held back.
  double round_trip_us_ = 0;
  std::chrono::microseconds clients_round_trip() const;
  std::thread host_thread_;  // serve_host
  std::thread watchdog_;
  std::atomic<bool> stopping_{false};  // the destructor ends the service early
  std::vector<std::chrono::steady_clock::time_point> last_seen_;  // per rank, the last message
  std::vector<std::chrono::steady_clock::time_point> asked_;      // per rank, the last request

  // This rank's record.
  mutable std::mutex record_mutex_;
  std::vector<ExecutedGroup> history_;
  std::vector<double> latencies_ms_;
  std::int64_t max_buffer_len_ = 0;
  std::int64_t last_round_trip_us_ = 0;  // a client's previous acquire(), sent with the next
  std::optional<std::uint64_t> executing_;
  bool left_ = false;  // left, or lingered until told DONE
  bool lingering_ = false;
  std::optional<std::uint64_t> final_round_id_;  // with DONE: see final_round_id()
  bool closed_self_ = false;
};

}  // namespace bagua
