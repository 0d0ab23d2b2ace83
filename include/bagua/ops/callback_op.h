// An op that calls a user function with the bucket's name: how custom
// algorithms (and `BaguaBucket.append_python_op`) run their own code in the
// bucket's place in the communication order.
//
// On a CUDA bucket the function runs on the host and launches on its own
// streams, which know nothing of the communication stream: the op first
// waits (on the host, within the timeout) for the communication stream, so
// the tensors' ready events and the earlier ops' work are complete. The
// function must in turn finish its own device work before it returns.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "bagua/core/env.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/compute.h"

namespace bagua {

class CallbackOp final : public CommOp {
 public:
  explicit CallbackOp(std::function<void(const std::string& bucket_name)> callback)
      : callback_(std::move(callback)) {
    BAGUA_CHECK_ARG(static_cast<bool>(callback_), "callback op: the function is empty");
  }

  std::string_view name() const override { return "python_op"; }
  void execute(Bucket& bucket) override {
    if (bucket.device().type == DeviceType::kCUDA) {
      compute_for(bucket.device())
          ->finish("python op of bucket '" + bucket.name() + "'", env().comm_timeout);
    }
    callback_(bucket.name());
  }

 private:
  std::function<void(const std::string&)> callback_;
};

}  // namespace bagua
