// CommOp: the interface of one communication primitive applied to a bucket
// (the ops themselves live in bagua/ops/, one header each), and ByteMeter,
// which counts what an op's communicators send.
//
// Contract: `execute` runs on the backend's communication thread, one op at a
// time, in the order the ops were appended to the bucket, on every rank in
// the same order. It reads and writes only the bucket's tensors and its own
// scratch state, blocks until its communication is done, and reports failure
// by throwing (the backend stores the exception and rethrows it where the
// training thread waits). Options are validated when the op is constructed,
// before any communication happens.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "bagua/comm/communicator.h"

namespace bagua {

class Bucket;

class CommOp {
 public:
  virtual ~CommOp() = default;
  virtual std::string_view name() const = 0;
  virtual void execute(Bucket& bucket) = 0;
  // Makes the op's communicators unusable (Communicator::abort): the backend
  // calls it, from any thread, when the op failed or overran the timeout, so
  // that this rank issues no further collective its peers may not match and
  // a call in flight ends as soon as the transport allows. Ops without
  // communicators of their own keep the default.
  virtual void abort_communication() noexcept {}

  // Bytes this op has sent over all its executions (the communicators'
  // payload counts, see CommCounters).
  std::int64_t bytes_sent() const { return bytes_sent_.load(); }

 protected:
  // Counts what the given communicators send from construction to
  // destruction into the op's bytes_sent(). Null communicators are skipped.
  class ByteMeter {
   public:
    ByteMeter(CommOp& op, std::initializer_list<const Communicator*> comms) : op_(op) {
      for (const auto* comm : comms) {
        if (comm != nullptr) {
          comms_.push_back(comm);
          start_ += comm->counters().bytes_sent.load();
        }
      }
    }
    ~ByteMeter() {
      std::int64_t now = 0;
      for (const auto* comm : comms_) now += comm->counters().bytes_sent.load();
      op_.bytes_sent_ += now - start_;
    }
    ByteMeter(const ByteMeter&) = delete;
    ByteMeter& operator=(const ByteMeter&) = delete;

   private:
    CommOp& op_;
    std::vector<const Communicator*> comms_;
    std::int64_t start_ = 0;
  };

 private:
  std::atomic<std::int64_t> bytes_sent_{0};
};

}  // namespace bagua
