#include "bagua/core/task_thread.h"

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {

TaskThread::TaskThread() : thread_([this] { serve(); }) {}

TaskThread::~TaskThread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_one();
  thread_.join();  // after the queued tasks: they may use the caller's buffers
}

std::int64_t TaskThread::submit(std::function<void()> task) {
  std::int64_t ticket = 0;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    errors_.emplace_back();
    ticket = submitted_++;
  }
  work_.notify_one();
  return ticket;
}

void TaskThread::wait(std::int64_t ticket, std::chrono::milliseconds timeout,
                      std::string_view what) {
  std::unique_lock lock(mutex_);
  BAGUA_CHECK_INTERNAL(ticket >= 0 && ticket < submitted_, "TaskThread: no task {}", ticket);
  if (!done_.wait_for(lock, timeout, [&] { return finished_ > ticket; })) {
    throw TimeoutError(
        fmt::format("{}: a compression task did not end within {} ms", what, timeout.count()));
  }
  if (errors_[static_cast<std::size_t>(ticket)]) {
    std::rethrow_exception(errors_[static_cast<std::size_t>(ticket)]);
  }
}

std::int64_t TaskThread::tasks_run() const {
  std::lock_guard lock(mutex_);
  return finished_;
}

void TaskThread::serve() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[static_cast<std::size_t>(finished_)] = error;
    ++finished_;
    done_.notify_all();
  }
}

}  // namespace bagua
