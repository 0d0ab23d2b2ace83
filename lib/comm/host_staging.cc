#include "bagua/comm/host_staging.h"

#include <cstddef>
#include <vector>

#include "bagua/core/cuda_support.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace {

// A host buffer for one staged view: pinned when CUDA can pin it.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { cuda_pinned_free(data_); }

  void* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      cuda_pinned_free(data_);
      data_ = cuda_pinned_alloc(bytes);
      capacity_ = bytes;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

class HostStagingCommunicator final : public Communicator {
 public:
  explicit HostStagingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {
    BAGUA_CHECK_ARG(inner_ != nullptr, "with_host_staging: no communicator");
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend_name() const override {
    return inner_->backend_name() + " (CUDA buffers staged through host memory)";
  }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  bool supports(DeviceType type) const override {
    return type == DeviceType::kCPU || (type == DeviceType::kCUDA && cuda_compiled());
  }

  void allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->allreduce(in, s.out(recv, send, in), op);
  }
  void reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->reduce(in, s.out(recv, send, in), root, op);
  }
  void broadcast(const TensorView& buffer, int root) override {
    Staging s(*this);
    const auto in = s.in(buffer);
    s.mark_output(buffer, in);
    inner_->broadcast(in, root);
  }
  void allgather(const TensorView& send, const TensorView& recv) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->allgather(in, s.out(recv, send, in));
  }
  void gather(const TensorView& send, const TensorView& recv, int root) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->gather(in, s.out(recv, send, in), root);
  }
  void scatter(const TensorView& send, const TensorView& recv, int root) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->scatter(in, s.out(recv, send, in), root);
  }
  void reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->reduce_scatter(in, s.out(recv, send, in), op);
  }
  void alltoall(const TensorView& send, const TensorView& recv) override {
    Staging s(*this);
    const auto in = s.in(send);
    inner_->alltoall(in, s.out(recv, send, in));
  }
  void send(const TensorView& buffer, int peer) override {
    Staging s(*this);
    inner_->send(s.in(buffer), peer);
  }
  void recv(const TensorView& buffer, int peer) override {
    Staging s(*this);
    const TensorView host = s.out(buffer, TensorView{}, TensorView{});
    inner_->recv(host, peer);
  }
  void send_recv(std::span<const PeerMessage> sends,
                 std::span<const PeerMessage> receives) override {
    Staging s(*this);
    std::vector<PeerMessage> host_sends;
    std::vector<PeerMessage> host_receives;
    for (const auto& m : sends) host_sends.push_back({s.in(m.buffer), m.peer});
    for (const auto& m : receives) {
      host_receives.push_back({s.out(m.buffer, TensorView{}, TensorView{}), m.peer});
    }
    inner_->send_recv(host_sends, host_receives);
  }
  void barrier() override { inner_->barrier(); }
  void abort() noexcept override { inner_->abort(); }

  std::unique_ptr<Communicator> new_group(std::span<const int> ranks) override {
    auto group = inner_->new_group(ranks);
    return group ? with_host_staging(std::move(group)) : nullptr;
  }

 private:
  // The staged views of one call. Outputs on the device are copied back when
  // the call returns normally (the destructor), then the counters follow the
  // inner communicator's.
  class Staging {
   public:
    explicit Staging(HostStagingCommunicator& owner) : owner_(owner) {}
    Staging(const Staging&) = delete;
    Staging& operator=(const Staging&) = delete;
    ~Staging() {
      if (std::uncaught_exceptions() == 0) {
        for (const auto& [device, host] : outputs_) {
          if (device.nbytes() > 0) cuda_copy(device.data, host.data, device.nbytes());
        }
      }
      auto& mine = owner_.counters_;
      const auto& inner = owner_.inner_->counters();
      mine.bytes_sent = inner.bytes_sent.load();
      mine.bytes_received = inner.bytes_received.load();
      mine.calls = inner.calls.load();
    }

    // A host view holding `view`'s data.
    TensorView in(const TensorView& view) {
      if (view.device.type != DeviceType::kCUDA) return view;
      TensorView host = host_buffer(view);
      if (view.nbytes() > 0) cuda_copy(host.data, view.data, view.nbytes());
      return host;
    }
    // A host view for the output `view`; in place (view is `input`) reuses
    // the staged input.
    TensorView out(const TensorView& view, const TensorView& input,
                   const TensorView& staged_input) {
      if (view.device.type != DeviceType::kCUDA) return view;
      TensorView host =
          view.data == input.data && input.data != nullptr ? staged_input : host_buffer(view);
      outputs_.emplace_back(view, host);
      return host;
    }
    void mark_output(const TensorView& device, const TensorView& host) {
      if (device.device.type == DeviceType::kCUDA) outputs_.emplace_back(device, host);
    }

   private:
    TensorView host_buffer(const TensorView& view) {
      if (owner_.buffers_.size() <= used_)
        owner_.buffers_.push_back(std::make_unique<PinnedBuffer>());
      void* data = owner_.buffers_[used_++]->reserve(view.nbytes());
      return TensorView{data, view.numel, view.dtype, Device{}};
    }

    HostStagingCommunicator& owner_;
    std::size_t used_ = 0;
    std::vector<std::pair<TensorView, TensorView>> outputs_;
  };

  std::unique_ptr<Communicator> inner_;
  std::vector<std::unique_ptr<PinnedBuffer>> buffers_;
};

}  // namespace

std::unique_ptr<Communicator> with_host_staging(std::unique_ptr<Communicator> inner) {
  return std::make_unique<HostStagingCommunicator>(std::move(inner));
}

}  // namespace bagua
