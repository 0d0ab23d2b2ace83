// Asynchronous model average: ranks average their weights in the background
// while training goes on, so a slow rank never stalls the others.
//
// A background thread runs rounds, every sync_interval:
//   1. agree: allreduce(max) of "someone asked to abort"; if so, every rank
//      stops after the same round (ranks with different step counts included);
//   2. snapshot the weights (under the weight lock);
//   3. allreduce(sum) the snapshot into a temporary (no lock held);
//   4. under the weight lock: w += sum / n - snapshot (progress made by the
//      optimizer since the snapshot is kept, nothing is lost).
// The weight lock: training holds it while it reads or writes the weights
// (`lock_weight` before forward, `unlock_weight` after the optimizer step).
// Whoever holds the lock performs pending snapshot/update work first: the
// training thread in lock_weight, or the background thread itself when the
// lock is free. So updates land at step boundaries and never starve.
//
// CUDA weights: the lock is host-side, but the training stream's kernels
// run later than the host. So `unlock_weight(stream)` records an event on
// the training stream, and the snapshot/update work (kernels on the op's
// own stream) waits on it on the device; `lock_weight(stream)` records one
// too and makes its own service wait on it. Every service ends with the
// host waiting for the op's stream, so work the training thread enqueues
// after lock_weight returns comes after the update.
//
// Bounded staleness (options.max_staleness_steps = K > 0): the training
// thread reports each local step (`count_step`) and, before the next one,
// calls `wait_within_staleness`: once K steps were taken since the last
// completed round it waits, without the weight lock, until a round completes
// (the background thread then services the round itself). So no rank runs
// more than K local steps between two completed rounds. K = 0: unbounded
// (Bagua's behaviour).
//
// Drift (`stats()`): per round, the steps counted since the previous round,
// the round's duration (agreement to update applied) and the distance
// ||snapshot - average|| of this rank's weights to the round's average
// (host loop, or a reduction kernel on the op's stream for CUDA buckets). A
// summary goes to the log at info at most every kLogEvery, and each round is
// a span on the timeline when one is set.
//
// A service that throws (a device wait past the timeout, say) leaves the
// weight lock free: the failure is the round's, stored and reported by
// status()/rethrow_failure(); training can still lock the weights.
//
// Threading: lock_weight/unlock_weight from the training thread;
// abort/resume/reset/status from any thread. Lock order: weight lock, then
// the state lock. Every wait is bounded by the communicator's timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/core/cuda.h"
#include "bagua/core/event_pool.h"
#include "bagua/core/timeline.h"
#include "bagua/ops/peer_selection.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct AsyncModelAverageOptions {
  PeerSelection peer_selection = PeerSelection::kAll;
  std::chrono::milliseconds sync_interval{500};
  // Local steps a rank may take between two completed rounds; 0: unbounded.
  std::int64_t max_staleness_steps = 0;
};

// What the rounds of one op did on this rank (see "Drift" above). Squared
// distances are over the op's bucket.
struct AsyncRoundStats {
  std::int64_t rounds = 0;            // completed rounds
  std::int64_t steps = 0;             // local steps counted
  std::int64_t last_round_steps = 0;  // steps between the last two completions
  std::int64_t max_round_steps = 0;
  std::int64_t steps_in_rounds = 0;  // steps up to the last completion
  double last_round_ms = 0, max_round_ms = 0, total_round_ms = 0;
  double last_drift_sq = 0, max_drift_sq = 0;  // ||snapshot - average||^2
  double last_average_sq = 0;                  // ||average||^2
  std::int64_t staleness_waits = 0;
  double staleness_wait_ms = 0;
};

enum class AsyncStatus : std::uint8_t { kIdle, kRunning, kStopped, kFailed };

constexpr std::string_view to_string(AsyncStatus status) {
  switch (status) {
    case AsyncStatus::kIdle: return "idle";
    case AsyncStatus::kRunning: return "running";
    case AsyncStatus::kStopped: return "stopped";
    case AsyncStatus::kFailed: return "failed";
  }
  return "unknown";
}

class AsyncModelAverageOp final : public CommOp {
 public:
  // `comm` must be this op's own communicator: the background rounds must not
  // interleave with any other collective.
  AsyncModelAverageOp(std::shared_ptr<Communicator> comm, const Bucket& bucket,
                      AsyncModelAverageOptions options);
  ~AsyncModelAverageOp() override;

  std::string_view name() const override { return "asynchronous_model_average"; }
  // Starts the background rounds if they are idle (not after abort: see resume).
  void execute(Bucket& bucket) override;

  void lock_weight() { lock(false, nullptr); }
  void unlock_weight() { unlock(false, nullptr); }
  // For CUDA weights: `cuda_stream` is the training stream (a cudaStream_t;
  // nullptr is the legacy default stream), see above.
  void lock_weight_on_stream(void* cuda_stream) { lock(true, cuda_stream); }
  void unlock_weight_on_stream(void* cuda_stream) { unlock(true, cuda_stream); }
  // Asks every rank to stop (agreed at the next round) and waits until this
  // rank's background thread has finished its last round.
  void abort();
  // Collective: starts the rounds again after abort.
  void resume();
  // Stops the rounds if running and clears a failure; the next execute starts
  // afresh.
  void reset();
  AsyncStatus status() const;
  std::int64_t completed_rounds() const;
  AsyncRoundStats stats() const;

  // Training thread: one more local step was taken (after the optimizer
  // step, once per step whatever the number of optimizers).
  void count_step();
  // Training thread, before a step, not holding the weight lock: with a
  // staleness bound, waits until a round completes if max_staleness_steps
  // steps were taken since the last one. Returns at once when the rounds
  // are not running; rethrows the rounds' failure; TimeoutError after
  // sync_interval + 2 x the communicator's timeout.
  void wait_within_staleness();
  // Rounds and staleness waits become spans on this timeline (set before
  // execute; null: none).
  void set_timeline(std::shared_ptr<Timeline> timeline) { timeline_ = std::move(timeline); }
  static constexpr std::chrono::seconds kLogEvery{10};
  // The failure of the background thread, if it failed (rethrown).
  void rethrow_failure() const;

  // Testing: `fault` runs at the start of every snapshot/update service
  // (under the weight lock, on whichever thread services); what it throws
  // is what a failing device wait or copy would throw there. Set before
  // execute(); empty: none.
  void set_service_fault_for_testing(std::function<void()> fault) {
    service_fault_ = std::move(fault);
  }

 private:
  void lock(bool on_stream, void* cuda_stream);
  void unlock(bool on_stream, void* cuda_stream);
  void start_locked();
  void loop(const std::stop_token& stop);
  // Collective: whether any rank asked to abort (the same answer everywhere).
  bool any_rank_aborting();
  // One round: snapshot, allreduce(sum) of the snapshots, update.
  void average_round(const std::stop_token& stop);
  // ||snapshot - sum / n||^2 and ||sum / n||^2 over the bucket (a kernel
  // and a copy of two doubles for CUDA buckets).
  std::pair<double, double> drift_squared();
  // Records a completed round in stats_ (state lock held).
  void record_round_locked(std::chrono::steady_clock::duration took,
                           std::pair<double, double> drift);
  void log_stats(std::string_view when, const AsyncRoundStats& stats) const;
  // Snapshot / update work requested by the background thread; the caller
  // holds the weight lock. `after` (CUDA: an event on the training stream,
  // or null) must complete before the work starts.
  void service_locked(void* after = nullptr);
  // Waits until `done()` holds, doing the work itself when the weight lock
  // is free.
  template <typename Done>
  void await_service(const std::stop_token& stop, Done&& done);

  std::shared_ptr<Communicator> comm_;
  std::string bucket_name_;  // names the op's bucket in its errors
  std::vector<TensorView> weights_;
  std::int64_t numel_ = 0;
  DType dtype_;
  AsyncModelAverageOptions options_;

  std::mutex weight_mutex_;
  mutable std::mutex state_mutex_;
  std::condition_variable_any state_changed_;
  bool abort_requested_ = false;
  bool want_snapshot_ = false;
  bool delta_ready_ = false;
  AsyncStatus status_ = AsyncStatus::kIdle;
  std::exception_ptr failure_;
  std::int64_t rounds_ = 0;
  std::int64_t steps_since_round_ = 0;
  AsyncRoundStats stats_;
  std::chrono::steady_clock::time_point last_log_{};
  std::shared_ptr<Timeline> timeline_;

  // Snapshot and sum buffers on the weights' device, and the compute that
  // fills them: host loops, or kernels on a stream of this op's own (CUDA).
  Device device_;
  Stream stream_;  // CUDA only
  std::unique_ptr<Compute> compute_;
  CachingAllocator::Block snapshot_;
  CachingAllocator::Block sum_;
  CachingAllocator::Block drift_out_;  // CUDA: the drift reduction's two doubles
  // CUDA: recorded on the training stream by the last unlock_weight (guarded
  // by the weight lock).
  EventPool::Lease released_;
  std::function<void()> service_fault_;  // testing only
  std::jthread thread_;
};

}  // namespace bagua
