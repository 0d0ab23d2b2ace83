// A thread of one call's own that runs tasks in the order they were
// submitted while the submitting thread does something else. C_LP_S uses one
// to compress and decompress the segments of a bucket while its
// communication thread sends and receives the neighbouring segments: on a
// slow link the passes then hide behind the bytes on the wire.
//
// Tasks must not wait for the submitting thread (they only compute), so
// every task ends. The destructor runs the tasks already submitted, then
// joins the thread: the buffers the tasks use must outlive the TaskThread,
// also when the submitting thread leaves by an exception.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

namespace bagua {

class TaskThread {
 public:
  TaskThread();
  ~TaskThread();
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;

  // Queues `task`; the ticket names it in wait().
  std::int64_t submit(std::function<void()> task);

  // Blocks until the task `ticket` has run and rethrows what it threw. A task
  // still not done after `timeout` is a TimeoutError naming `what`.
  void wait(std::int64_t ticket, std::chrono::milliseconds timeout, std::string_view what);

  // Tasks run so far (for tests).
  std::int64_t tasks_run() const;

 private:
  void serve();

  mutable std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable done_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::exception_ptr> errors_;  // by ticket
  std::int64_t submitted_ = 0;
  std::int64_t finished_ = 0;  // tasks run, in ticket order
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace bagua
