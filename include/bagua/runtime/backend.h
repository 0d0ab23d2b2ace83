// The backend: readiness tracking and the communication thread.
//
// Contract:
// - `register_ordered_buckets` fixes the buckets and their order. Every rank
//   registers the same buckets in the same order, so executing them in that
//   order issues the same collectives everywhere without negotiation.
// - The training thread calls `mark_communication_ready(name)` as each
//   tensor's data is final (a gradient after accumulation, a weight before
//   forward). When the first not-yet-scheduled bucket has all its tensors
//   ready it is handed to the communication thread, then the next one, and so
//   on: strictly in registration order, overlapping with the backward pass.
// - CUDA tensors are marked with the stream that produces them
//   (`mark_communication_ready_on_stream`): an event from the pool is
//   recorded there, and the communication stream waits on it on the device
//   before the bucket's ops run; neither thread waits for the whole device.
//   After a CUDA bucket's ops the communication thread waits for the
//   communication stream, so the results are in memory when
//   `wait_pending_comm_ops` returns.
// - `wait_pending_comm_ops` blocks until every bucket of the iteration has
//   run its ops, rethrows the first failure of the communication thread, and
//   then starts a new iteration. While it waits, a queued host bucket that
//   the idle communication thread has not taken yet runs on the waiting
//   thread instead (still one bucket at a time, in order). A wait longer
//   than the timeout becomes a TimeoutError naming the rank, the op and the
//   bucket, or the tensors that were never marked ready.
// - After a failure the backend stays failed: every later call rethrows it.
//   The communication thread runs no further bucket (queued ones complete at
//   once, unexecuted), and the communicators of an op that failed or overran
//   the timeout are aborted (CommOp::abort_communication), so a failed rank
//   issues no collective its peers may not match.
// - Destruction waits for the op in flight only, which its communicator's
//   timeout bounds (and which is aborted already after a failure); no later
//   bucket starts.
//
// Threading: the training-thread methods may be called from one thread at a
// time (autograd hooks and the post-backward callback); the communication
// thread is owned here and joined on destruction.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bagua/core/event_pool.h"
#include "bagua/core/timeline.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

struct BackendOptions {
  int rank = 0;
  // Zero means BAGUA_COMM_TIMEOUT_S.
  std::chrono::milliseconds timeout{0};
  // Records readiness and ops when set (BAGUA_TIMELINE); null: nothing.
  std::shared_ptr<Timeline> timeline;
};

class Backend {
 public:
  explicit Backend(BackendOptions options);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  void register_ordered_buckets(std::vector<std::shared_ptr<Bucket>> buckets);
  void mark_communication_ready(const std::string& tensor_name);
  // For a tensor of a CUDA bucket: its data is final once the work enqueued
  // on `cuda_stream` (a cudaStream_t; nullptr is the legacy default stream)
  // so far is done.
  void mark_communication_ready_on_stream(const std::string& tensor_name, void* cuda_stream);
  // Before the tensor is marked ready this iteration: its bucket reads and
  // writes `view` from now on instead of its registered memory (the same
  // size, dtype and device). The training loop replaced the tensor (a fresh
  // gradient after zero_grad(set_to_none=True)); adopting it saves the copy
  // into the old memory.
  void rebind_tensor(const std::string& tensor_name, const TensorView& view);
  // Marks every tensor not yet marked this iteration (unused parameters),
  // in bucket order, so all ranks still run every bucket.
  void mark_remaining_ready();
  void wait_pending_comm_ops();

  // Names of the tensors in the order they were marked ready during the last
  // completed iteration (tensors marked by mark_remaining_ready come last).
  std::vector<std::string> last_ready_order() const;
  std::size_t completed_iterations() const;
  // Per bucket: tensors, bytes, and per op the number of executions and the
  // seconds spent, as a JSON object (since the last registration).
  std::string stats_json() const;
  const std::vector<std::shared_ptr<Bucket>>& buckets() const { return buckets_; }
  // Names of the tensors not yet marked ready this iteration, in bucket order.
  std::vector<std::string> unready_tensor_names() const;

 private:
  struct OpStats {
    std::int64_t executions = 0;
    double total_seconds = 0.0;
  };

  struct TensorSlot {
    std::size_t bucket;
    std::size_t tensor;
  };

  // The (bucket, tensor) indices of a registered tensor; InvalidArgument
  // naming the rank when there is none.
  TensorSlot slot_locked(const std::string& tensor_name) const;
  void mark_locked(const std::string& tensor_name, std::unique_lock<std::mutex>& lock,
                   const void* const* cuda_stream = nullptr);
  // Runs the bucket's ops, returning the first failure (null on success).
  std::exception_ptr run_bucket(std::size_t index, Bucket& bucket);
  // The ready events of a CUDA bucket's tensors, taken for this run.
  std::vector<EventPool::Lease> take_ready_events(std::size_t index, const Bucket& bucket);
  // Runs one op of the bucket, recording its time (stats, timeline).
  void run_op(std::size_t index, std::size_t op_index, Bucket& bucket);
  std::exception_ptr annotate(const std::exception& e, std::string_view op,
                              const Bucket& bucket) const;
  void schedule_ready_buckets_locked();
  void rethrow_if_failed_locked() const;
  std::string describe_pending_locked() const;
  void communication_loop(const std::stop_token& stop);
  // Whether the next queued bucket may start now (none is running, no
  // failure), and on the waiting training thread (a host bucket).
  bool can_start_locked() const { return !queue_.empty() && !bucket_running_ && !failure_; }
  bool can_start_here_locked() const {
    return can_start_locked() && buckets_[queue_.front()]->device().type == DeviceType::kCPU;
  }
  // Runs the next queued bucket on the calling thread (the lock is released
  // meanwhile) and counts it completed.
  void run_next_locked(std::unique_lock<std::mutex>& lock);
  // The waiting training thread's share: the queued host buckets while no
  // bucket runs.
  void run_queued_here_locked(std::unique_lock<std::mutex>& lock);

  BackendOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable_any changed_;

  std::vector<std::shared_ptr<Bucket>> buckets_;
  std::unordered_map<std::string, TensorSlot> slots_;
  std::vector<std::vector<bool>> tensor_ready_;
  // Per bucket and tensor: the event recorded when a CUDA tensor was marked.
  std::vector<std::vector<EventPool::Lease>> ready_events_;
  std::vector<std::size_t> ready_count_;
  std::size_t next_to_schedule_ = 0;
  std::size_t completed_ = 0;
  std::deque<std::size_t> queue_;
  std::vector<std::string> ready_order_;
  std::vector<std::string> last_ready_order_;
  std::size_t iterations_ = 0;
  std::vector<std::vector<OpStats>> op_stats_;  // [bucket][op]

  // What the communication thread is doing, for timeout messages, and the
  // op in flight, to abort it when the training thread's wait times out.
  std::string running_op_;
  std::string running_bucket_;
  bool bucket_running_ = false;  // on either thread: buckets run one at a time
  std::shared_ptr<CommOp> running_comm_op_;
  std::exception_ptr failure_;

  std::jthread thread_;  // last member: joined before the state it uses goes away
};

}  // namespace bagua
