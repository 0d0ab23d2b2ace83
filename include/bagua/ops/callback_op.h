// An op that calls a user function with the bucket's name: how custom
// algorithms (and `BaguaBucket.append_python_op`) run their own code in the
// bucket's place in the communication order.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "bagua/ops/comm_op.h"
#include "bagua/runtime/bucket.h"

namespace bagua {

class CallbackOp final : public CommOp {
 public:
  explicit CallbackOp(std::function<void(const std::string& bucket_name)> callback)
      : callback_(std::move(callback)) {
    BAGUA_CHECK_ARG(static_cast<bool>(callback_), "callback op: the function is empty");
  }

  std::string_view name() const override { return "python_op"; }
  void execute(Bucket& bucket) override { callback_(bucket.name()); }

 private:
  std::function<void(const std::string&)> callback_;
};

}  // namespace bagua
