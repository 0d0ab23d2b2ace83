// Host staging of CUDA buffers for a host-only communicator; see
// bagua/comm/host_staging.h for the contract.
#include "bagua/comm/host_staging.h"

#include <cstddef>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/cuda.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace {

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

  void abort() noexcept override { inner_->abort(); }
  std::vector<int> lost_peers() override { return inner_->lost_peers(); }

 protected:
  // Each call stages its device buffers and hands the host views to the
  // inner communicator's (checked) entry point.
  void do_allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->allreduce(in, out, op); });
  }
  void do_reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->reduce(in, out, root, op); });
  }
  void do_broadcast(const TensorView& buffer, int root) override {
    staged(buffer, buffer,
           [&](const auto& in, const auto& /*out*/) { inner_->broadcast(in, root); });
  }
  void do_allgather(const TensorView& send, const TensorView& recv) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->allgather(in, out); });
  }
  void do_gather(const TensorView& send, const TensorView& recv, int root) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->gather(in, out, root); });
  }
  void do_scatter(const TensorView& send, const TensorView& recv, int root) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->scatter(in, out, root); });
  }
  void do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    staged(send, recv,
           [&](const auto& in, const auto& out) { inner_->reduce_scatter(in, out, op); });
  }
  void do_alltoall(const TensorView& send, const TensorView& recv) override {
    staged(send, recv, [&](const auto& in, const auto& out) { inner_->alltoall(in, out); });
  }
  void do_send_recv(std::span<const PeerMessage> sends,
                    std::span<const PeerMessage> receives) override {
    Staging s(*this);
    std::vector<PeerMessage> host_sends;
    std::vector<PeerMessage> host_receives;
    for (const auto& m : sends) host_sends.push_back({s.in(m.buffer), m.peer, m.tag});
    for (const auto& m : receives) {
      host_receives.push_back({s.out(m.buffer, TensorView{}, TensorView{}), m.peer, m.tag});
    }
    inner_->send_recv(host_sends, host_receives);
    s.finish();
  }
  void do_barrier() override { inner_->barrier(); }
  int do_recv_any(const TensorView& buffer, std::span<const int> peers, std::uint64_t tag,
                  bool wait_forever) override {
    BAGUA_CHECK_ARG(buffer.device.type == DeviceType::kCPU, "recv_any takes a host buffer, got {}",
                    buffer.describe());
    return inner_->recv_any(buffer, peers, tag, wait_forever);
  }
  void do_recv_from(const TensorView& buffer, int peer, std::uint64_t tag,
                    bool wait_forever) override {
    BAGUA_CHECK_ARG(buffer.device.type == DeviceType::kCPU, "recv_from takes a host buffer, got {}",
                    buffer.describe());
    inner_->recv_from(buffer, peer, tag, wait_forever);
  }
  void do_partial_allreduce(const TensorView& send, const TensorView& recv,
                            std::span<const int> members, ReduceOp op, std::uint64_t group_id,
                            bool verify) override {
    staged(send, recv, [&](const auto& in, const auto& out) {
      inner_->partial_allreduce(in, out, members, op, group_id, verify);
    });
  }

  std::unique_ptr<Communicator> do_new_group(std::span<const int> ranks) override {
    auto group = inner_->new_group(ranks);
    return group ? with_host_staging(std::move(group)) : nullptr;
  }
  std::unique_ptr<Communicator> do_new_bucket_group(std::span<const int> ranks) override {
    auto group = inner_->new_bucket_group(ranks);
    return group ? with_host_staging(std::move(group)) : nullptr;
  }

 private:
  // call(host input, host output) with `send` staged in and `recv` staged out
  // (in place, send == recv, shares one host buffer).
  template <typename Call>
  void staged(const TensorView& send, const TensorView& recv, Call&& call) {
    Staging s(*this);
    const auto in = s.in(send);
    call(in, s.out(recv, send, in));
    s.finish();
  }

  // The staged views of one call: CUDA inputs are copied into pinned host
  // blocks (from the pool) on the communication stream, in order after the
  // device work that produced them; `finish` copies the device outputs back
  // and waits for the copies. The counters follow the inner communicator's.
  class Staging {
   public:
    explicit Staging(HostStagingCommunicator& owner) : owner_(owner) {}
    Staging(const Staging&) = delete;
    Staging& operator=(const Staging&) = delete;
    ~Staging() {
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
      void* stream = cuda_communication_stream(view.device.index);
      cuda_copy_async(host.data, view.data, view.nbytes(), stream);
      wait(stream, "copy to host");
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

    // After the inner call succeeded: the outputs go back to the device.
    void finish() {
      for (const auto& [device, host] : outputs_) {
        void* stream = cuda_communication_stream(device.device.index);
        cuda_copy_async(device.data, host.data, device.nbytes(), stream);
        // Waited for before the pinned block returns to the pool.
        wait(stream, "copy to the device");
      }
    }

   private:
    TensorView host_buffer(const TensorView& view) {
      blocks_.push_back(pinned_host_pool().allocate(view.nbytes()));
      return TensorView{blocks_.back().data(), view.numel, view.dtype, Device{}};
    }
    void wait(void* stream, const char* what) {
      cuda_stream_wait(stream, owner_.timeout(),
                       fmt::format("rank {}: host staging ({})", owner_.rank(), what));
    }

    HostStagingCommunicator& owner_;
    std::vector<CachingAllocator::Block> blocks_;
    std::vector<std::pair<TensorView, TensorView>> outputs_;
  };

  std::unique_ptr<Communicator> inner_;
};

}  // namespace

std::unique_ptr<Communicator> with_host_staging(std::unique_ptr<Communicator> inner) {
  return std::make_unique<HostStagingCommunicator>(std::move(inner));
}

}  // namespace bagua
