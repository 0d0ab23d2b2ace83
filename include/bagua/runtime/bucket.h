// A bucket: an ordered list of same-dtype, same-device tensors communicated
// together, and the ordered list of comm ops applied to them.
//
// Flattened buckets have their tensors back to back in one buffer (the
// Python layer makes parameters' gradients views into it), so ops work on the
// memory in place. A bucket that is not flattened is packed into a staging
// buffer before its ops run and unpacked afterwards; both paths give the same
// result, flattening only saves the copies.
//
// Threading: built on the training thread, then only touched by the
// communication thread while its ops run.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/runtime/comm_op.h"

namespace bagua {

struct BucketTensor {
  std::string name;
  TensorView view;
};

class Bucket {
 public:
  Bucket(std::string name, std::vector<BucketTensor> tensors)
      : name_(std::move(name)), tensors_(std::move(tensors)) {
    BAGUA_CHECK_ARG(!tensors_.empty(), "bucket '{}' has no tensors", name_);
    for (const auto& tensor : tensors_) {
      BAGUA_CHECK_ARG(tensor.view.dtype == dtype() && tensor.view.device == device(),
                      "bucket '{}' mixes {} ({}) with {} ({}): a bucket holds one dtype on one "
                      "device",
                      name_, tensors_.front().name, tensors_.front().view.describe(), tensor.name,
                      tensor.view.describe());
      BAGUA_CHECK_ARG(tensor.view.numel == 0 || tensor.view.data != nullptr,
                      "bucket '{}': tensor '{}' has no data", name_, tensor.name);
      numel_ += tensor.view.numel;
    }
  }

  const std::string& name() const { return name_; }
  const std::vector<BucketTensor>& tensors() const { return tensors_; }
  DType dtype() const { return tensors_.front().view.dtype; }
  Device device() const { return tensors_.front().view.device; }
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * dtype_size(dtype()); }

  // True when the tensors lie back to back in memory, in order.
  bool is_flat() const {
    for (std::size_t i = 1; i < tensors_.size(); ++i) {
      const auto& prev = tensors_[i - 1].view;
      if (prev.bytes() + prev.nbytes() != tensors_[i].view.bytes()) return false;
    }
    return true;
  }

  // Points tensor `index` at other memory of the same size, dtype and device
  // (a gradient autograd allocated afresh, adopted instead of copied in; see
  // Backend::rebind_tensor). A flat bucket then stops being flat and
  // with_flat_view stages it. Ops find their tensors through tensors() when
  // they run, never through pointers kept from before.
  void rebind_tensor(std::size_t index, const TensorView& view) {
    BAGUA_CHECK_ARG(index < tensors_.size(), "bucket '{}' has no tensor {}", name_, index);
    BucketTensor& tensor = tensors_[index];
    BAGUA_CHECK_ARG(view.numel == tensor.view.numel && view.dtype == tensor.view.dtype &&
                        view.device == tensor.view.device &&
                        (view.numel == 0 || view.data != nullptr),
                    "bucket '{}': tensor '{}' ({}) cannot move to {}", name_, tensor.name,
                    tensor.view.describe(), view.describe());
    tensor.view = view;
  }

  void append_op(std::shared_ptr<CommOp> op) {
    BAGUA_CHECK_ARG(op != nullptr, "bucket '{}': cannot append a null op", name_);
    ops_.push_back(std::move(op));
  }
  const std::vector<std::shared_ptr<CommOp>>& ops() const { return ops_; }
  void clear_ops() { ops_.clear(); }

  // Runs fn(TensorView) on all of the bucket's elements as one contiguous
  // view: the memory itself when flat, otherwise a staging copy that is
  // written back into the tensors when fn returns normally.
  template <typename Fn>
  void with_flat_view(Fn&& fn) {
    if (is_flat()) {
      fn(TensorView{tensors_.front().view.data, numel_, dtype(), device()});
      return;
    }
    BAGUA_CHECK_ARG(
        device().type == DeviceType::kCPU,
        "bucket '{}' on {} is not flattened: CUDA buckets must be flat (do_flatten=True)", name_,
        device().str());
    staging_.resize(nbytes());
    std::size_t offset = 0;
    for (const auto& tensor : tensors_) {
      if (tensor.view.nbytes() > 0)
        std::memcpy(staging_.data() + offset, tensor.view.data, tensor.view.nbytes());
      offset += tensor.view.nbytes();
    }
    fn(TensorView{staging_.data(), numel_, dtype(), device()});
    offset = 0;
    for (const auto& tensor : tensors_) {
      if (tensor.view.nbytes() > 0)
        std::memcpy(tensor.view.data, staging_.data() + offset, tensor.view.nbytes());
      offset += tensor.view.nbytes();
    }
  }

 private:
  std::string name_;
  std::vector<BucketTensor> tensors_;
  std::int64_t numel_ = 0;
  std::vector<std::shared_ptr<CommOp>> ops_;
  std::vector<std::byte> staging_;
};

}  // namespace bagua
