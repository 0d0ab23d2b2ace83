// The backend: readiness, in-order scheduling of buckets and the
// communication thread; see bagua/runtime/backend.h for the contract.
#include "bagua/runtime/backend.h"

#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"

namespace bagua {

Backend::Backend(BackendOptions options) : options_(std::move(options)) {
  if (options_.timeout.count() <= 0) options_.timeout = env().comm_timeout;
  thread_ = std::jthread([this](const std::stop_token& stop) { communication_loop(stop); });
}

Backend::~Backend() {
  thread_.request_stop();
  changed_.notify_all();
  // jthread joins here: a running op finishes or hits its transport timeout
  // (after a failure it was aborted already); no queued bucket starts.
}

void Backend::register_ordered_buckets(std::vector<std::shared_ptr<Bucket>> buckets) {
  std::unique_lock lock(mutex_);
  rethrow_if_failed_locked();
  BAGUA_CHECK_ARG(next_to_schedule_ == completed_ && queue_.empty() && running_bucket_.empty(),
                  "rank {}: register_ordered_buckets while communication is in flight; call "
                  "wait_pending_comm_ops first",
                  options_.rank);
  std::unordered_map<std::string, TensorSlot> slots;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    BAGUA_CHECK_ARG(buckets[b] != nullptr, "rank {}: bucket {} is null", options_.rank, b);
    const auto& tensors = buckets[b]->tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const bool inserted = slots.emplace(tensors[t].name, TensorSlot{b, t}).second;
      BAGUA_CHECK_ARG(inserted, "rank {}: tensor '{}' appears in more than one bucket slot",
                      options_.rank, tensors[t].name);
    }
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  tensor_ready_.assign(buckets_.size(), {});
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    tensor_ready_[b].assign(buckets_[b]->tensors().size(), false);
  }
  ready_events_.clear();
  ready_events_.resize(buckets_.size());
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    ready_events_[b].resize(buckets_[b]->tensors().size());
  }
  ready_count_.assign(buckets_.size(), 0);
  op_stats_.assign(buckets_.size(), {});
  next_to_schedule_ = 0;
  completed_ = 0;
  ready_order_.clear();
  log().debug("rank {}: registered {} buckets", options_.rank, buckets_.size());
}

void Backend::mark_communication_ready(const std::string& tensor_name) {
  std::unique_lock lock(mutex_);
  mark_locked(tensor_name, lock);
}

void Backend::mark_communication_ready_on_stream(const std::string& tensor_name,
                                                 void* cuda_stream) {
  std::unique_lock lock(mutex_);
  mark_locked(tensor_name, lock, &cuda_stream);
}

Backend::TensorSlot Backend::slot_locked(const std::string& tensor_name) const {
  const auto found = slots_.find(tensor_name);
  BAGUA_CHECK_ARG(found != slots_.end(), "rank {}: tensor '{}' is not in any registered bucket",
                  options_.rank, tensor_name);
  return found->second;
}

void Backend::mark_locked(const std::string& tensor_name, std::unique_lock<std::mutex>& lock,
                          const void* const* cuda_stream) {
  rethrow_if_failed_locked();
  const auto [b, t] = slot_locked(tensor_name);
  BAGUA_CHECK_ARG(!tensor_ready_[b][t],
                  "rank {}: tensor '{}' of bucket '{}' was marked ready twice in one iteration "
                  "(missing wait_pending_comm_ops?)",
                  options_.rank, tensor_name, buckets_[b]->name());
  const Device device = buckets_[b]->device();
  if (cuda_stream != nullptr && device.type == DeviceType::kCUDA) {
    // Record where the producing stream is now; the bucket's ops wait for it.
    auto event = cuda_event_pool(device.index).acquire();
    cuda_event_record(event.get(), const_cast<void*>(*cuda_stream));
    ready_events_[b][t] = std::move(event);
  }
  tensor_ready_[b][t] = true;
  ready_count_[b] += 1;
  ready_order_.push_back(tensor_name);
  if (options_.timeline) {
    options_.timeline->instant("ready " + tensor_name, "tensor_ready", Timeline::kTrainingLane,
                               {{"bucket", buckets_[b]->name()}});
  }
  schedule_ready_buckets_locked();
  if (!queue_.empty()) {
    lock.unlock();
    changed_.notify_all();
  }
}

void Backend::rebind_tensor(const std::string& tensor_name, const TensorView& view) {
  std::unique_lock lock(mutex_);
  rethrow_if_failed_locked();
  const auto [b, t] = slot_locked(tensor_name);
  // Not ready yet: its bucket cannot run this iteration, and the last one's
  // ops finished in wait_pending_comm_ops.
  BAGUA_CHECK_ARG(!tensor_ready_[b][t],
                  "rank {}: tensor '{}' of bucket '{}' cannot move to other memory after it was "
                  "marked ready",
                  options_.rank, tensor_name, buckets_[b]->name());
  buckets_[b]->rebind_tensor(t, view);
}

void Backend::mark_remaining_ready() {
  std::unique_lock lock(mutex_);
  rethrow_if_failed_locked();
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    for (std::size_t t = 0; t < buckets_[b]->tensors().size(); ++t) {
      if (!tensor_ready_[b][t]) {
        tensor_ready_[b][t] = true;
        ready_count_[b] += 1;
      }
    }
  }
  schedule_ready_buckets_locked();
  lock.unlock();
  changed_.notify_all();
}

void Backend::schedule_ready_buckets_locked() {
  while (next_to_schedule_ < buckets_.size() &&
         ready_count_[next_to_schedule_] == buckets_[next_to_schedule_]->tensors().size()) {
    queue_.push_back(next_to_schedule_);
    ++next_to_schedule_;
  }
}

void Backend::wait_pending_comm_ops() {
  std::unique_lock lock(mutex_);
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  const auto done = [&] { return failure_ != nullptr || completed_ == buckets_.size(); };
  bool finished = false;
  do {
    run_queued_here_locked(lock);
    finished =
        changed_.wait_until(lock, deadline, [&] { return done() || can_start_here_locked(); });
  } while (finished && !done());
  rethrow_if_failed_locked();
  if (!finished) {
    auto error = TimeoutError(fmt::format(
        "rank {}: wait_pending_comm_ops timed out after {} ms (BAGUA_COMM_TIMEOUT_S): {}",
        options_.rank, options_.timeout.count(), describe_pending_locked()));
    failure_ = std::make_exception_ptr(error);
    // The op in flight will not be waited for: abort its communicators, so
    // it ends as soon as the transport allows and nothing follows it.
    const std::shared_ptr<CommOp> running = running_comm_op_;
    lock.unlock();
    if (running) running->abort_communication();
    changed_.notify_all();
    throw error;
  }
  for (auto& flags : tensor_ready_) flags.assign(flags.size(), false);
  ready_count_.assign(buckets_.size(), 0);
  next_to_schedule_ = 0;
  completed_ = 0;
  last_ready_order_ = std::move(ready_order_);
  ready_order_.clear();
  ++iterations_;
}

std::string Backend::stats_json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json buckets = nlohmann::json::array();
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = *buckets_[b];
    nlohmann::json ops = nlohmann::json::array();
    for (std::size_t o = 0; o < bucket.ops().size(); ++o) {
      const OpStats stats = o < op_stats_[b].size() ? op_stats_[b][o] : OpStats{};
      ops.push_back({{"name", bucket.ops()[o]->name()},
                     {"executions", stats.executions},
                     {"bytes_sent", bucket.ops()[o]->bytes_sent()},
                     {"total_seconds", stats.total_seconds}});
    }
    buckets.push_back({{"name", bucket.name()},
                       {"tensors", bucket.tensors().size()},
                       {"bytes", bucket.nbytes()},
                       {"flat", bucket.is_flat()},
                       {"ops", std::move(ops)}});
  }
  return nlohmann::json{{"rank", options_.rank},
                        {"completed_iterations", iterations_},
                        {"buckets", std::move(buckets)}}
      .dump();
}

std::vector<std::string> Backend::last_ready_order() const {
  std::lock_guard lock(mutex_);
  return last_ready_order_;
}

std::size_t Backend::completed_iterations() const {
  std::lock_guard lock(mutex_);
  return iterations_;
}

void Backend::rethrow_if_failed_locked() const {
  if (failure_) std::rethrow_exception(failure_);
}

std::string Backend::describe_pending_locked() const {
  if (!running_bucket_.empty()) {
    return fmt::format("op '{}' of bucket '{}' is still running (a peer may be missing or slow)",
                       running_op_, running_bucket_);
  }
  if (next_to_schedule_ < buckets_.size()) {
    const auto& bucket = *buckets_[next_to_schedule_];
    std::string missing;
    for (std::size_t t = 0; t < bucket.tensors().size(); ++t) {
      if (!tensor_ready_[next_to_schedule_][t]) {
        missing += (missing.empty() ? "" : ", ") + bucket.tensors()[t].name;
      }
    }
    return fmt::format("bucket '{}' never became ready: tensors not marked ready: [{}]",
                       bucket.name(), missing);
  }
  return fmt::format("{} of {} buckets completed", completed_, buckets_.size());
}

void Backend::communication_loop(const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    changed_.wait(lock, stop, [&] { return !queue_.empty() && !bucket_running_; });
    if (stop.stop_requested()) return;
    if (failure_) {
      // Failed: this rank issues no further collective. The bucket completes
      // unexecuted; the training thread's wait rethrows the stored failure.
      queue_.pop_front();
      ++completed_;
      continue;
    }
    run_next_locked(lock);
  }
}

void Backend::run_next_locked(std::unique_lock<std::mutex>& lock) {
  const std::size_t index = queue_.front();
  queue_.pop_front();
  auto bucket = buckets_[index];
  running_bucket_ = bucket->name();
  bucket_running_ = true;
  lock.unlock();
  const std::exception_ptr failure = run_bucket(index, *bucket);
  lock.lock();
  running_bucket_.clear();
  bucket_running_ = false;
  running_op_.clear();
  running_comm_op_.reset();
  if (failure && !failure_) failure_ = failure;
  ++completed_;
  lock.unlock();
  changed_.notify_all();
  lock.lock();
}

// The training thread would only sleep until the communication thread is
// done, and handing a bucket to that thread and the result back costs two
// wake-ups, each up to a scheduler time slice on a busy machine (several ms
// on the 2-core machine of docs/benchmarks.md). PowerSGD's one bucket,
// ready only at the end of backward, paid both every step. CUDA buckets stay
// on the communication thread, which owns the communication stream.
void Backend::run_queued_here_locked(std::unique_lock<std::mutex>& lock) {
  while (can_start_here_locked()) run_next_locked(lock);
}

std::exception_ptr Backend::run_bucket(std::size_t index, Bucket& bucket) {
  const Device device = bucket.device();
  std::optional<DeviceGuard> current;  // CUDA: the bucket's device, while its ops run
  void* stream = nullptr;
  std::vector<EventPool::Lease> events;  // returned to the pool after the stream wait
  if (device.type == DeviceType::kCUDA) {
    try {
      events = take_ready_events(index, bucket);
      current.emplace(device.index);
      stream = cuda_communication_stream(device.index);
      for (const auto& event : events) {
        if (event) cuda_stream_wait_event(stream, event.get());
      }
    } catch (const std::exception& e) {
      return annotate(e, "wait for ready events", bucket);
    }
  }
  for (std::size_t op_index = 0; op_index < bucket.ops().size(); ++op_index) {
    try {
      run_op(index, op_index, bucket);
    } catch (const std::exception& e) {
      // A timeout or transport failure leaves the peers mid-collective: abort
      // (an argument error was raised before anything was sent).
      if (dynamic_cast<const InvalidArgument*>(&e) == nullptr) {
        bucket.ops()[op_index]->abort_communication();
      }
      return annotate(e, bucket.ops()[op_index]->name(), bucket);
    }
  }
  if (stream != nullptr) {
    // The ops' device work is enqueued; the results must be in memory before
    // the training thread reads them (and before the events are reused).
    try {
      cuda_stream_wait(
          stream, options_.timeout,
          fmt::format("rank {}: device work of bucket '{}'", options_.rank, bucket.name()));
    } catch (const std::exception& e) {
      for (const auto& op : bucket.ops()) op->abort_communication();  // kernels may be stuck
      return annotate(e, "wait for the communication stream", bucket);
    }
  }
  return nullptr;
}

std::vector<EventPool::Lease> Backend::take_ready_events(std::size_t index, const Bucket& bucket) {
  std::lock_guard guard(mutex_);
  std::vector<EventPool::Lease> events = std::move(ready_events_[index]);
  ready_events_[index].clear();
  ready_events_[index].resize(bucket.tensors().size());
  return events;
}

void Backend::run_op(std::size_t index, std::size_t op_index, Bucket& bucket) {
  const auto& op = bucket.ops()[op_index];
  {
    std::lock_guard guard(mutex_);
    running_op_ = std::string(op->name());
    running_comm_op_ = op;
  }
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t start_us = options_.timeline ? options_.timeline->now_us() : 0;
  const std::int64_t bytes_before = op->bytes_sent();
  {
    const ThisThreadTimeline phases(options_.timeline.get());  // the op may mark its phases on it
    op->execute(bucket);
  }
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  if (options_.timeline) {
    options_.timeline->span(std::string(op->name()), "comm_op", Timeline::kCommunicationLane,
                            start_us, options_.timeline->now_us(),
                            {{"bucket", bucket.name()},
                             {"bytes_sent", op->bytes_sent() - bytes_before},
                             {"bucket_bytes", bucket.nbytes()}});
  }
  std::lock_guard guard(mutex_);
  auto& stats = op_stats_[index];
  if (stats.size() < bucket.ops().size()) stats.resize(bucket.ops().size());
  stats[op_index].executions += 1;
  stats[op_index].total_seconds += took.count();
}

std::exception_ptr Backend::annotate(const std::exception& e, std::string_view op,
                                     const Bucket& bucket) const {
  log().error("rank {}: op '{}' of bucket '{}' failed: {}", options_.rank, op, bucket.name(),
              e.what());
  // Name where it happened, keeping the original error type.
  const std::string message = fmt::format("rank {}: op '{}' of bucket '{}': {}", options_.rank, op,
                                          bucket.name(), e.what());
  if (dynamic_cast<const TimeoutError*>(&e)) {
    return std::make_exception_ptr(TimeoutError(message));
  }
  if (dynamic_cast<const InvalidArgument*>(&e)) {
    return std::make_exception_ptr(InvalidArgument(message));
  }
  if (dynamic_cast<const Error*>(&e)) return std::make_exception_ptr(BackendError(message));
  return std::make_exception_ptr(BackendError(fmt::format(
      "rank {}: op '{}' of bucket '{}' failed: {}", options_.rank, op, bucket.name(), e.what())));
}

std::vector<std::string> Backend::unready_tensor_names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    for (std::size_t t = 0; t < tensor_ready_[b].size(); ++t) {
      if (!tensor_ready_[b][t]) names.push_back(buckets_[b]->tensors()[t].name);
    }
  }
  return names;
}

}  // namespace bagua
