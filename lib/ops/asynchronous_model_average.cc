// The asynchronous model average op: its background rounds, the weight lock
// and the agreement on abort; see bagua/ops/asynchronous_model_average.h.
#include "bagua/ops/asynchronous_model_average.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "bagua/core/logging.h"
#include "bagua/ops/op_steps.h"
#include "bagua/runtime/cuda_compute.h"

namespace bagua {

AsyncModelAverageOp::AsyncModelAverageOp(std::shared_ptr<Communicator> comm, const Bucket& bucket,
                                         AsyncModelAverageOptions options)
    : comm_(std::move(comm)),
      bucket_name_(bucket.name()),
      dtype_(bucket.dtype()),
      options_(options) {
  BAGUA_CHECK_ARG(comm_ != nullptr, "asynchronous model average: no communicator");
  BAGUA_CHECK_ARG(options_.peer_selection == PeerSelection::kAll,
                  "asynchronous model average supports peer_selection_mode 'all' only, got '{}'",
                  to_string(options_.peer_selection));
  BAGUA_CHECK_ARG(options_.sync_interval.count() >= 0, "sync_interval_ms must be >= 0, got {}",
                  options_.sync_interval.count());
  BAGUA_CHECK_ARG(options_.max_staleness_steps >= 0,
                  "max_staleness_steps must be >= 0 (0: unbounded), got {}",
                  options_.max_staleness_steps);
  BAGUA_CHECK_ARG(is_floating_point(dtype_),
                  "asynchronous model average averages floating point weights, got {}",
                  to_string(dtype_));
  for (const auto& tensor : bucket.tensors()) weights_.push_back(tensor.view);
  numel_ = bucket.numel();
  device_ = bucket.device();
  if (device_.type == DeviceType::kCUDA) {
    // Its own stream: rounds run while the buckets' path uses the
    // communication stream.
    stream_ = Stream(device_.index);
    compute_ = make_cuda_compute(device_.index, stream_.get());
  } else {
    compute_ = std::make_unique<HostCompute>();
  }
  snapshot_ = compute_->scratch(bucket.nbytes());
  sum_ = compute_->scratch(bucket.nbytes());
  if (device_.type == DeviceType::kCUDA) drift_out_ = compute_->scratch(2 * sizeof(double));
}

AsyncModelAverageOp::~AsyncModelAverageOp() {
  std::unique_lock lock(state_mutex_);
  abort_requested_ = true;
  lock.unlock();
  if (thread_.joinable()) {
    thread_.request_stop();
    state_changed_.notify_all();
    thread_.join();
  }
  if (stream_.get() != nullptr) {
    // Nothing of ours may still run when the blocks go back to the pool.
    try {
      compute_->finish("asynchronous model average shutdown", comm_->timeout());
    } catch (const std::exception& e) {
      log().warn("rank {}: asynchronous model average shutdown: {}", comm_->rank(), e.what());
    }
    released_.reset();
    drift_out_.reset();
    snapshot_.reset();
    sum_.reset();
    compute_.reset();
    stream_.reset();
  }
}

void AsyncModelAverageOp::execute(Bucket& /*bucket*/) {
  std::lock_guard lock(state_mutex_);
  if (status_ == AsyncStatus::kIdle) start_locked();
}

void AsyncModelAverageOp::start_locked() {
  if (thread_.joinable()) thread_.join();  // a finished earlier loop
  abort_requested_ = false;
  want_snapshot_ = false;
  delta_ready_ = false;
  failure_ = nullptr;
  steps_since_round_ = 0;  // the bound counts from (re)start
  status_ = AsyncStatus::kRunning;
  thread_ = std::jthread([this](const std::stop_token& stop) { loop(stop); });
}

// The weight lock is held from lock() to unlock() across calls, so it is a
// unique_lock released to the caller only once lock() has succeeded; on every
// other path (a failing event record, service or device wait) the guard
// unlocks it.
void AsyncModelAverageOp::lock(bool on_stream, void* cuda_stream) {
  std::unique_lock weights(weight_mutex_);
  EventPool::Lease now;
  if (on_stream && device_.type == DeviceType::kCUDA) {
    now = cuda_event_pool(device_.index).acquire();
    cuda_event_record(now.get(), cuda_stream);
  }
  service_locked(now.get());
  weights.release();  // held until unlock()
}

void AsyncModelAverageOp::unlock(bool on_stream, void* cuda_stream) {
  const std::unique_lock weights(weight_mutex_, std::adopt_lock);  // unlocked on every path
  if (on_stream && device_.type == DeviceType::kCUDA) {
    auto event = cuda_event_pool(device_.index).acquire();
    cuda_event_record(event.get(), cuda_stream);
    released_ = std::move(event);
  }
}

void AsyncModelAverageOp::abort() {
  {
    std::lock_guard lock(state_mutex_);
    if (status_ != AsyncStatus::kRunning) return;
    abort_requested_ = true;
  }
  state_changed_.notify_all();
  // The background thread finishes its round (it may need the weight lock:
  // it takes it itself, the caller must not hold it) and then agrees to stop.
  std::unique_lock lock(state_mutex_);
  const auto deadline =
      std::chrono::steady_clock::now() + options_.sync_interval + 2 * comm_->timeout();
  state_changed_.wait_until(lock, deadline, [&] { return status_ != AsyncStatus::kRunning; });
  if (status_ == AsyncStatus::kRunning) {
    throw TimeoutError(
        fmt::format("rank {}: asynchronous model average did not stop within {} ms of abort()",
                    comm_->rank(), (options_.sync_interval + 2 * comm_->timeout()).count()));
  }
}

void AsyncModelAverageOp::resume() {
  std::lock_guard lock(state_mutex_);
  if (status_ == AsyncStatus::kRunning) return;  // as abort(): a second call changes nothing
  start_locked();
}

void AsyncModelAverageOp::reset() {
  abort();
  std::lock_guard lock(state_mutex_);
  if (thread_.joinable()) thread_.join();
  status_ = AsyncStatus::kIdle;
  failure_ = nullptr;
}

AsyncStatus AsyncModelAverageOp::status() const {
  std::lock_guard lock(state_mutex_);
  return status_;
}

std::int64_t AsyncModelAverageOp::completed_rounds() const {
  std::lock_guard lock(state_mutex_);
  return rounds_;
}

AsyncRoundStats AsyncModelAverageOp::stats() const {
  std::lock_guard lock(state_mutex_);
  return stats_;
}

void AsyncModelAverageOp::count_step() {
  std::lock_guard lock(state_mutex_);
  ++steps_since_round_;
  ++stats_.steps;
}

void AsyncModelAverageOp::wait_within_staleness() {
  const std::int64_t bound = options_.max_staleness_steps;
  std::unique_lock lock(state_mutex_);
  if (bound == 0 || steps_since_round_ < bound) return;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = options_.sync_interval + 2 * comm_->timeout();
  const std::int64_t steps = steps_since_round_;
  // Running, the background thread completes a round (servicing it itself:
  // the caller does not hold the weight lock), which resets the count.
  state_changed_.wait_until(lock, start + limit, [&] {
    return status_ != AsyncStatus::kRunning || steps_since_round_ < bound;
  });
  if (failure_) std::rethrow_exception(failure_);
  if (status_ == AsyncStatus::kRunning && steps_since_round_ >= bound) {
    throw TimeoutError(fmt::format(
        "rank {}: op '{}' of bucket '{}': waited {} ms for an averaging round after {} local "
        "steps (max_staleness_steps={}); is a peer stalled?",
        comm_->rank(), name(), bucket_name_, limit.count(), steps, bound));
  }
  const auto end = std::chrono::steady_clock::now();
  ++stats_.staleness_waits;
  stats_.staleness_wait_ms += std::chrono::duration<double, std::milli>(end - start).count();
  lock.unlock();
  if (timeline_) {
    const auto us = [](auto d) {
      return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    };
    const std::int64_t end_us = timeline_->now_us();
    timeline_->span("staleness_wait", "async_model_average", Timeline::kTrainingLane,
                    end_us - us(end - start), end_us,
                    {{"bucket", bucket_name_}, {"steps", steps}, {"bound", bound}});
  }
}

void AsyncModelAverageOp::rethrow_failure() const {
  std::lock_guard lock(state_mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

void AsyncModelAverageOp::service_locked(void* after) {
  std::unique_lock lock(state_mutex_);
  if (!want_snapshot_ && !delta_ready_) return;
  if (service_fault_) service_fault_();
  if (device_.type == DeviceType::kCUDA) {
    // The training stream's work on the weights comes first.
    if (released_) cuda_stream_wait_event(stream_.get(), released_.get());
    if (after != nullptr) cuda_stream_wait_event(stream_.get(), after);
  }
  const TensorView snapshot{snapshot_.data(), numel_, dtype_, device_};
  const TensorView sum{sum_.data(), numel_, dtype_, device_};
  if (want_snapshot_) {
    std::int64_t offset = 0;
    for (const auto& w : weights_) {
      compute_->copy(snapshot.slice(offset, w.numel).data, w.data, w.nbytes());
      offset += w.numel;
    }
  }
  if (delta_ready_) {
    std::int64_t offset = 0;
    for (const auto& w : weights_) {
      apply_async_average_update(*compute_, w, sum.slice(offset, w.numel),
                                 snapshot.slice(offset, w.numel), comm_->size());
      offset += w.numel;
    }
  }
  // Done before anyone reads the snapshot (the allreduce) or the weights.
  compute_->finish(fmt::format("rank {}: asynchronous model average", comm_->rank()),
                   comm_->timeout());
  want_snapshot_ = false;
  delta_ready_ = false;
  lock.unlock();
  state_changed_.notify_all();
}

template <typename Done>
void AsyncModelAverageOp::await_service(const std::stop_token& stop, Done&& done) {
  const auto deadline = std::chrono::steady_clock::now() + comm_->timeout();
  while (true) {
    {
      std::unique_lock lock(state_mutex_);
      if (done()) return;
    }
    if (std::unique_lock weights(weight_mutex_, std::try_to_lock); weights.owns_lock()) {
      service_locked();  // training is not using the weights: do it here
      continue;
    }
    std::unique_lock lock(state_mutex_);
    state_changed_.wait_for(lock, stop, std::chrono::milliseconds(5), [&] { return done(); });
    if (stop.stop_requested()) throw InternalError("asynchronous model average: stopped");
    if (std::chrono::steady_clock::now() > deadline) {
      throw TimeoutError(
          fmt::format("rank {}: asynchronous model average waited {} ms for the weight lock (is "
                      "unlock_weight() missing?)",
                      comm_->rank(), comm_->timeout().count()));
    }
  }
}

void AsyncModelAverageOp::loop(const std::stop_token& stop) {
  try {
    while (!stop.stop_requested()) {
      {
        std::unique_lock lock(state_mutex_);
        state_changed_.wait_for(lock, stop, options_.sync_interval,
                                [&] { return abort_requested_; });
      }
      if (stop.stop_requested()) break;
      const ByteMeter meter(*this, {comm_.get()});
      if (any_rank_aborting()) break;  // every rank sees the same answer: all stop here
      average_round(stop);
    }
    std::lock_guard lock(state_mutex_);
    status_ = AsyncStatus::kStopped;
    log_stats("stopped", stats_);
  } catch (const std::exception& e) {
    // Rethrown on the training thread, where the user sees it: it must say
    // which op and bucket failed (a dead peer shows only as Gloo's address).
    const std::string where = fmt::format("rank {}: op '{}' of bucket '{}' (background round)",
                                          comm_->rank(), name(), bucket_name_);
    log().error("{} failed: {}", where, e.what());
    std::lock_guard lock(state_mutex_);
    failure_ = with_context(e, where);
    status_ = AsyncStatus::kFailed;
    // No round will use a snapshot or an update now: lock_weight has
    // nothing left to do.
    want_snapshot_ = false;
    delta_ready_ = false;
  }
  state_changed_.notify_all();
}

bool AsyncModelAverageOp::any_rank_aborting() {
  std::int32_t flag = 0;
  {
    std::lock_guard lock(state_mutex_);
    flag = abort_requested_ ? 1 : 0;
  }
  const TensorView flag_view{&flag, 1, DType::kInt32, {}};
  comm_->allreduce(flag_view, flag_view, ReduceOp::kMax);
  return flag != 0;
}

void AsyncModelAverageOp::average_round(const std::stop_token& stop) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t start_us = timeline_ ? timeline_->now_us() : 0;
  {
    std::lock_guard lock(state_mutex_);
    want_snapshot_ = true;
  }
  await_service(stop, [&] { return !want_snapshot_; });
  const TensorView snapshot{snapshot_.data(), numel_, dtype_, device_};
  const TensorView sum{sum_.data(), numel_, dtype_, device_};
  comm_->allreduce(snapshot, sum, ReduceOp::kSum);
  const auto drift = drift_squared();  // the buffers are ours until the update
  {
    std::lock_guard lock(state_mutex_);
    delta_ready_ = true;
  }
  await_service(stop, [&] { return !delta_ready_; });
  std::unique_lock lock(state_mutex_);
  ++rounds_;
  const std::int64_t steps = steps_since_round_;
  record_round_locked(std::chrono::steady_clock::now() - start, drift);
  const AsyncRoundStats round_stats = stats_;
  const auto now = std::chrono::steady_clock::now();
  const bool log_now = now - last_log_ >= kLogEvery;
  if (log_now) last_log_ = now;
  lock.unlock();
  state_changed_.notify_all();  // a training thread may wait for this round
  if (log_now) log_stats("running", round_stats);
  if (timeline_) {
    timeline_->span("async_round", "async_model_average", Timeline::kBackgroundLane, start_us,
                    timeline_->now_us(),
                    {{"bucket", bucket_name_},
                     {"round", round_stats.rounds},
                     {"steps", steps},
                     {"drift", std::sqrt(drift.first)},
                     {"average_norm", std::sqrt(drift.second)}});
  }
}

std::pair<double, double> AsyncModelAverageOp::drift_squared() {
  if (device_.type == DeviceType::kCUDA) {
    // A reduction on the op's stream, the two doubles copied back.
    const TensorView snapshot{snapshot_.data(), numel_, dtype_, device_};
    const TensorView sum{sum_.data(), numel_, dtype_, device_};
    auto* d_out = static_cast<double*>(drift_out_.data());
    compute_->zero(d_out, 2 * sizeof(double));
    compute_->run_custom([] {},
                         [&](void* stream) {
                           cuda_async_average_drift(sum, snapshot, comm_->size(), d_out, stream);
                         });
    double host[2] = {0, 0};
    cuda_copy_async(host, d_out, sizeof host, stream_.get());
    compute_->finish(fmt::format("rank {}: asynchronous model average drift", comm_->rank()),
                     comm_->timeout());
    return {host[0], host[1]};
  }
  double drift = 0, average = 0;
  const double n = comm_->size();
  dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    const T* sums = static_cast<const T*>(sum_.data());
    const T* snapshots = static_cast<const T*>(snapshot_.data());
    for (std::int64_t i = 0; i < numel_; ++i) {
      const double mean = static_cast<double>(load(sums[i])) / n;
      const double d = static_cast<double>(load(snapshots[i])) - mean;
      drift += d * d;
      average += mean * mean;
    }
  });
  return {drift, average};
}

void AsyncModelAverageOp::record_round_locked(std::chrono::steady_clock::duration took,
                                              std::pair<double, double> drift) {
  AsyncRoundStats& s = stats_;
  const double ms = std::chrono::duration<double, std::milli>(took).count();
  s.rounds = rounds_;
  s.last_round_steps = steps_since_round_;
  s.max_round_steps = std::max(s.max_round_steps, steps_since_round_);
  s.steps_in_rounds = s.steps;
  s.last_round_ms = ms;
  s.max_round_ms = std::max(s.max_round_ms, ms);
  s.total_round_ms += ms;
  s.last_drift_sq = drift.first;
  s.max_drift_sq = std::max(s.max_drift_sq, drift.first);
  s.last_average_sq = drift.second;
  steps_since_round_ = 0;
}

void AsyncModelAverageOp::log_stats(std::string_view when, const AsyncRoundStats& s) const {
  const double rounds = static_cast<double>(std::max<std::int64_t>(s.rounds, 1));
  const double relative =
      s.last_average_sq > 0 ? std::sqrt(s.last_drift_sq / s.last_average_sq) : 0.0;
  log().info(
      "rank {}: asynchronous model average of bucket '{}' {}: {} rounds, {:.1f} steps/round "
      "(last {}, max {}, bound {}), round {:.1f} ms (last {:.1f}, max {:.1f}), drift to the "
      "average {:.4g} (relative {:.3g}, max {:.4g}), {} staleness waits ({:.0f} ms)",
      comm_->rank(), bucket_name_, when, s.rounds, static_cast<double>(s.steps_in_rounds) / rounds,
      s.last_round_steps, s.max_round_steps,
      options_.max_staleness_steps > 0 ? std::to_string(options_.max_staleness_steps) : "none",
      s.total_round_ms / rounds, s.last_round_ms, s.max_round_ms, std::sqrt(s.last_drift_sq),
      relative, std::sqrt(s.max_drift_sq), s.staleness_waits, s.staleness_wait_ms);
}

}  // namespace bagua
