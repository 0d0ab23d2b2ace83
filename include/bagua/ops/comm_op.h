// One communication primitive applied to a bucket.
//
// Contract: `execute` runs on the backend's communication thread, one op at a
// time, in the order the ops were appended to the bucket, on every rank in
// the same order. It reads and writes only the bucket's tensors and its own
// scratch state, blocks until its communication is done, and reports failure
// by throwing (the backend stores the exception and rethrows it where the
// training thread waits). Options are validated when the op is constructed,
// before any communication happens.
#pragma once

#include <string_view>

namespace bagua {

class Bucket;

class CommOp {
 public:
  virtual ~CommOp() = default;
  virtual std::string_view name() const = 0;
  virtual void execute(Bucket& bucket) = 0;
};

}  // namespace bagua
