#include "bagua/ops/asynchronous_model_average.h"

#include <cstring>

#include <fmt/format.h>

#include "bagua/core/elementwise.h"
#include "bagua/core/logging.h"

namespace bagua {

AsyncModelAverageOp::AsyncModelAverageOp(std::shared_ptr<Communicator> comm, const Bucket& bucket,
                                         AsyncModelAverageOptions options)
    : comm_(std::move(comm)), dtype_(bucket.dtype()), options_(options) {
  BAGUA_CHECK_ARG(comm_ != nullptr, "asynchronous model average: no communicator");
  BAGUA_CHECK_ARG(options_.peer_selection == PeerSelection::kAll,
                  "asynchronous model average supports peer_selection_mode 'all' only, got '{}'",
                  to_string(options_.peer_selection));
  BAGUA_CHECK_ARG(options_.sync_interval.count() >= 0, "sync_interval_ms must be >= 0, got {}",
                  options_.sync_interval.count());
  BAGUA_CHECK_ARG(is_floating_point(dtype_),
                  "asynchronous model average averages floating point weights, got {}",
                  to_string(dtype_));
  for (const auto& tensor : bucket.tensors()) weights_.push_back(tensor.view);
  numel_ = bucket.numel();
  snapshot_.resize(bucket.nbytes());
  sum_.resize(bucket.nbytes());
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
  status_ = AsyncStatus::kRunning;
  thread_ = std::jthread([this](const std::stop_token& stop) { loop(stop); });
}

void AsyncModelAverageOp::lock_weight() {
  weight_mutex_.lock();
  service_locked();
}

void AsyncModelAverageOp::unlock_weight() { weight_mutex_.unlock(); }

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
  BAGUA_CHECK_ARG(status_ != AsyncStatus::kRunning, "rank {}: resume() while already running",
                  comm_->rank());
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

void AsyncModelAverageOp::rethrow_failure() const {
  std::lock_guard lock(state_mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

void AsyncModelAverageOp::service_locked() {
  std::unique_lock lock(state_mutex_);
  if (want_snapshot_) {
    std::size_t offset = 0;
    for (const auto& w : weights_) {
      std::memcpy(snapshot_.data() + offset, w.data, w.nbytes());
      offset += w.nbytes();
    }
    want_snapshot_ = false;
  }
  if (delta_ready_) {
    const std::int64_t n = comm_->size();
    std::int64_t offset = 0;
    for (const auto& w : weights_) {
      dispatch_dtype(dtype_, [&](auto tag) {
        using T = decltype(tag);
        T* dst = w.data_as<T>();
        const T* sum = reinterpret_cast<const T*>(sum_.data()) + offset;
        const T* snapshot = reinterpret_cast<const T*>(snapshot_.data()) + offset;
        for (std::int64_t i = 0; i < w.numel; ++i) {
          dst[i] = async_average_update(dst[i], sum[i], snapshot[i], n);
        }
      });
      offset += w.numel;
    }
    delta_ready_ = false;
  }
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
    if (weight_mutex_.try_lock()) {  // training is not using the weights: do it here
      service_locked();
      weight_mutex_.unlock();
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
      std::int32_t flag = 0;
      {
        std::lock_guard lock(state_mutex_);
        flag = abort_requested_ ? 1 : 0;
      }
      const ByteMeter meter(*this, {comm_.get()});
      const TensorView flag_view{&flag, 1, DType::kInt32, {}};
      comm_->allreduce(flag_view, flag_view, ReduceOp::kMax);
      if (flag != 0) break;  // every rank sees the same flag: all stop here

      {
        std::lock_guard lock(state_mutex_);
        want_snapshot_ = true;
      }
      await_service(stop, [&] { return !want_snapshot_; });
      const TensorView snapshot{snapshot_.data(), numel_, dtype_, {}};
      const TensorView sum{sum_.data(), numel_, dtype_, {}};
      comm_->allreduce(snapshot, sum, ReduceOp::kSum);
      {
        std::lock_guard lock(state_mutex_);
        delta_ready_ = true;
      }
      await_service(stop, [&] { return !delta_ready_; });
      std::lock_guard lock(state_mutex_);
      ++rounds_;
    }
    std::lock_guard lock(state_mutex_);
    status_ = AsyncStatus::kStopped;
  } catch (const std::exception& e) {
    log().error("rank {}: asynchronous model average failed: {}", comm_->rank(), e.what());
    std::lock_guard lock(state_mutex_);
    failure_ = std::current_exception();
    status_ = AsyncStatus::kFailed;
  }
  state_changed_.notify_all();
}

}  // namespace bagua
