// The NCCL backend. See bagua/comm/nccl_communicator.h for the contract.
//
// NCCL's functions come from dlopen("libnccl.so.2") through one table
// (NcclLibrary, comm/nccl_library.h). Every NCCL and CUDA call goes through
// check_nccl() / check_cuda(), the error checks of core/cuda_checks.h, which
// turn a failure into a BackendError naming the call, the op and the rank. Arguments arrive checked
// (Communicator's entry points); point-to-point parts of a call are one Exchange, posted in one
// NCCL group.
#include "bagua/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/group_tags.h"
#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "comm/nccl_library.h"
#include "core/cuda_checks.h"
#include "launchers.h"  // the ring's reduction kernel (kernels/reduce_kernels.cu)

namespace bagua {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Store> store, int rank, int size, NcclOptions options)
      : lib_(NcclLibrary::get()),
        store_(std::move(store)),
        options_(std::move(options)),
        rank_(rank),
        size_(size) {
    if (options_.timeout.count() <= 0) options_.timeout = env().comm_timeout;
    check_cuda(cudaSetDevice(options_.device), "cudaSetDevice", "connect");
    if (options_.communication_stream) {
      stream_ = static_cast<cudaStream_t>(cuda_communication_stream(options_.device));
    } else {
      owned_stream_ = Stream(options_.device);
      stream_ = static_cast<cudaStream_t>(owned_stream_.get());
    }
    ncclUniqueId id{};
    const std::string key = options_.prefix + "/nccl_unique_id";
    if (rank_ == 0) {
      check_nccl(lib_.get_unique_id(&id), "ncclGetUniqueId", "connect");
      store_->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      store_->wait({key}, options_.timeout);
      const auto bytes = store_->get(key);
      BAGUA_CHECK_INTERNAL(bytes.size() == sizeof(id.internal), "NCCL unique id of {} bytes",
                           bytes.size());
      std::memcpy(id.internal, bytes.data(), bytes.size());
    }
    check_nccl(lib_.comm_init_rank(&comm_, size_, id, rank_), "ncclCommInitRank", "connect");
    log().debug("nccl communicator '{}' ready: rank {} of {} on cuda:{}", options_.prefix, rank_,
                size_, options_.device);
  }

  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      const ncclResult_t result = aborted_.load() ? ncclSuccess : lib_.comm_destroy(comm_);
      if (result != ncclSuccess) {
        log().warn("rank {}: ncclCommDestroy failed: {}", rank_, lib_.get_error_string(result));
      }
    }
    owned_stream_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override {
    int version = 0;
    lib_.get_version(&version);
    return fmt::format("nccl {}", version);
  }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  bool supports(DeviceType /*type*/) const override { return true; }

  void abort() noexcept override {
    if (!aborted_.exchange(true) && comm_ != nullptr) lib_.comm_abort(comm_);
  }

 protected:
  void do_allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    count(recv.nbytes() * 2 * static_cast<std::size_t>(size_ - 1) /
          static_cast<std::size_t>(size_));
    run("allreduce", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.all_reduce(in[0].data, out[0].data, static_cast<std::size_t>(send.numel),
                             nccl_type(send.dtype), nccl_op(op), comm_, stream_);
    });
  }

  void do_reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) override {
    count(send.nbytes());
    const TensorView target = rank_ == root ? recv : send;
    run(
        "reduce", {send}, {target},
        [&](const auto& in, const auto& out) {
          // Non-roots pass their input as the (unused) output.
          return lib_.reduce(in[0].data, rank_ == root ? out[0].data : in[0].data,
                             static_cast<std::size_t>(send.numel), nccl_type(send.dtype),
                             nccl_op(op), root, comm_, stream_);
        },
        /*copy_back=*/rank_ == root);
  }

  void do_broadcast(const TensorView& buffer, int root) override {
    count(buffer.nbytes());
    run("broadcast", {buffer}, {buffer}, [&](const auto& in, const auto& out) {
      return lib_.broadcast(in[0].data, out[0].data, static_cast<std::size_t>(buffer.numel),
                            nccl_type(buffer.dtype), root, comm_, stream_);
    });
  }

  void do_allgather(const TensorView& send, const TensorView& recv) override {
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1));
    run("allgather", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.all_gather(in[0].data, out[0].data, static_cast<std::size_t>(send.numel),
                             nccl_type(send.dtype), comm_, stream_);
    });
  }

  void do_gather(const TensorView& send, const TensorView& recv, int root) override {
    count(send.nbytes());
    const TensorView target = rank_ == root ? recv : send;
    run(
        "gather", {send}, {target},
        [&](const auto& in, const auto& out) {
          return post("gather", with_root(/*gather=*/true, out[0], in[0], root));
        },
        /*copy_back=*/rank_ == root);
  }

  void do_scatter(const TensorView& send, const TensorView& recv, int root) override {
    count(recv.nbytes());
    const TensorView source = rank_ == root ? send : recv;
    run("scatter", {source}, {recv}, [&](const auto& in, const auto& out) {
      return post("scatter", with_root(/*gather=*/false, in[0], out[0], root));
    });
  }

  void do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1) / static_cast<std::size_t>(size_));
    run("reduce_scatter", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.reduce_scatter(in[0].data, out[0].data, static_cast<std::size_t>(recv.numel),
                                 nccl_type(recv.dtype), nccl_op(op), comm_, stream_);
    });
  }

  // Chunk r goes to rank r and chunk r comes from it (this rank's is a copy).
  void do_alltoall(const TensorView& send, const TensorView& recv) override {
    const std::int64_t chunk = send.numel / size_;
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1) / static_cast<std::size_t>(size_));
    run("alltoall", {send}, {recv}, [&](const auto& in, const auto& out) {
      Exchange exchange;
      for (int r = 0; r < size_; ++r) {
        const auto from = in[0].slice(r * chunk, chunk);
        const auto to = out[0].slice(r * chunk, chunk);
        exchange.add_send(from, to, r, rank_);
        if (r != rank_) exchange.receives.push_back({to, r});
      }
      return post("alltoall", exchange);
    });
  }

  void do_send_recv(std::span<const PeerMessage> sends,
                    std::span<const PeerMessage> receives) override {
    std::vector<TensorView> in;
    std::vector<TensorView> out;
    for (const auto& m : sends) {
      in.push_back(m.buffer);
      count(m.buffer.nbytes());
    }
    for (const auto& m : receives) out.push_back(m.buffer);
    run("send_recv", in, out, [&](const auto& d_in, const auto& d_out) {
      Exchange exchange;  // the same messages, on the staged device buffers
      for (std::size_t i = 0; i < sends.size(); ++i) {
        exchange.sends.push_back({d_in[i], sends[i].peer});
      }
      for (std::size_t i = 0; i < receives.size(); ++i) {
        exchange.receives.push_back({d_out[i], receives[i].peer});
      }
      return post("send_recv", exchange);
    });
  }

  void do_barrier() override {
    std::int32_t token = 0;
    const TensorView view{&token, 1, DType::kInt32, {}};
    allreduce(view, view, ReduceOp::kSum);
  }

  // P-Reduce. NCCL matches messages by peer and order, not by tag, so the
  // members first exchange (group key, numel, dtype, op) with their ring
  // neighbours: members that disagree about the group fail naming it (the
  // ones that see it: InvalidArgument; the rest time out) rather than mix
  // data. CUDA buffers then run the ring on the stream; host buffers take
  // the base class's ring, staged message by message.
  void do_partial_allreduce(const TensorView& send, const TensorView& recv,
                            std::span<const int> members, ReduceOp op, std::uint64_t group_id,
                            bool verify) override {
    BAGUA_CHECK_ARG(send.device.type == recv.device.type,
                    "partial_allreduce on rank {}: send and recv must be on the same device, got "
                    "{} and {}",
                    rank_, send.describe(), recv.describe());
    const DeviceRing ring = device_ring(members, group_id);
    naming_the_group(ring, [&] { check_neighbours_agree(ring, send, op); });
    if (send.device.type != DeviceType::kCUDA) {
      Communicator::do_partial_allreduce(send, recv, members, op, group_id, verify);
      return;
    }
    naming_the_group(ring, [&] { partial_allreduce_on_device(ring, send, recv, op); });
  }

  std::unique_ptr<Communicator> do_new_group(std::span<const int> ranks) override {
    return make_group(ranks, options_.communication_stream);
  }
  std::unique_ptr<Communicator> do_new_bucket_group(std::span<const int> ranks) override {
    return make_group(ranks, true);
  }

 private:
  // The point-to-point part of a call, on device buffers: messages posted in
  // one NCCL group, and this rank's own chunk copied on the stream.
  struct Exchange {
    std::vector<PeerMessage> sends;
    std::vector<PeerMessage> receives;
    std::vector<std::pair<TensorView, TensorView>> copies;  // (to, from)

    // `chunk` to `peer`, or into `own` when the peer is this rank.
    void add_send(const TensorView& chunk, const TensorView& own, int peer, int self) {
      if (peer == self) {
        copies.emplace_back(own, chunk);
      } else {
        sends.push_back({chunk, peer});
      }
    }
    // `chunk` from `peer`, or from `own` when the peer is this rank.
    void add_receive(const TensorView& chunk, const TensorView& own, int peer, int self) {
      if (peer == self) {
        copies.emplace_back(chunk, own);
      } else {
        receives.push_back({chunk, peer});
      }
    }
  };

  // The messages of a gather (the root receives chunk r of `whole` from rank
  // r) or a scatter (the root sends it); the root's own chunk is a copy
  // with `part`, any other rank exchanges `part` with the root.
  Exchange with_root(bool gather, const TensorView& whole, const TensorView& part, int root) const {
    Exchange exchange;
    if (rank_ != root) {
      (gather ? exchange.sends : exchange.receives).push_back({part, root});
      return exchange;
    }
    for (int r = 0; r < size_; ++r) {
      const auto chunk = whole.slice(r * part.numel, part.numel);
      if (gather) {
        exchange.add_receive(chunk, part, r, rank_);
      } else {
        exchange.add_send(chunk, part, r, rank_);
      }
    }
    return exchange;
  }

  // Enqueues the exchange's copies, then its messages in one NCCL group.
  ncclResult_t post(const char* op, const Exchange& exchange) {
    for (const auto& [to, from] : exchange.copies) copy_async(to, from);
    check_nccl(lib_.group_start(), "ncclGroupStart", op);
    for (const auto& m : exchange.sends) {
      check_nccl(lib_.send(m.buffer.data, static_cast<std::size_t>(m.buffer.numel),
                           nccl_type(m.buffer.dtype), m.peer, comm_, stream_),
                 "ncclSend", op);
    }
    for (const auto& m : exchange.receives) {
      check_nccl(lib_.recv(m.buffer.data, static_cast<std::size_t>(m.buffer.numel),
                           nccl_type(m.buffer.dtype), m.peer, comm_, stream_),
                 "ncclRecv", op);
    }
    return lib_.group_end();
  }

  // The P-Reduce's ring: this rank's place among the members.
  struct DeviceRing {
    std::span<const int> members;
    std::uint64_t group_id = 0;
    int me = 0;
    int m() const { return static_cast<int>(members.size()); }
    int next() const { return members[static_cast<std::size_t>((me + 1) % m())]; }
    int prev() const { return members[static_cast<std::size_t>((me + m() - 1) % m())]; }
  };

  DeviceRing device_ring(std::span<const int> members, std::uint64_t group_id) const {
    const auto at = std::find(members.begin(), members.end(), rank_);
    return {members, group_id, static_cast<int>(at - members.begin())};
  }

  std::string describe(const DeviceRing& ring) const {
    return fmt::format("partial_allreduce of group {} (ranks {}) on rank {}", ring.group_id,
                       fmt::join(ring.members, ","), rank_);
  }

  // Runs `step`; its errors name the group.
  template <typename Step>
  void naming_the_group(const DeviceRing& ring, Step&& step) const {
    try {
      step();
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("{}: {}", describe(ring), e.what()));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: {}", describe(ring), e.what()));
    } catch (const BackendError& e) {
      throw BackendError(fmt::format("{}: {}", describe(ring), e.what()));
    }
  }

  // Sends (key, numel, dtype, op) to the next and previous member and
  // compares what they sent.
  void check_neighbours_agree(const DeviceRing& ring, const TensorView& send, ReduceOp op) {
    constexpr int kFields = 4;
    const std::array<std::int64_t, kFields> mine{
        static_cast<std::int64_t>(group_tags::group_key(ring.members, ring.group_id)), send.numel,
        static_cast<std::int64_t>(send.dtype), static_cast<std::int64_t>(op)};
    std::array<std::int64_t, 2 * kFields> theirs{};
    const auto view = [](const std::int64_t* data) {
      return TensorView{const_cast<std::int64_t*>(data), kFields, DType::kInt64, {}};
    };
    const int next = ring.next(), prev = ring.prev();
    const PeerMessage sends[] = {{view(mine.data()), next}, {view(mine.data()), prev}};
    const PeerMessage receives[] = {{view(theirs.data()), prev},
                                    {view(theirs.data() + kFields), next}};
    send_recv(sends, receives);
    for (int side = 0; side < 2; ++side) {
      const std::int64_t* row = theirs.data() + side * kFields;
      if (std::equal(row, row + kFields, mine.begin())) continue;
      throw InvalidArgument(fmt::format(
          "rank {} passed {}[{}] op {}{}, this rank {}[{}] op {}", side == 0 ? prev : next,
          to_string(static_cast<DType>(row[2])), row[1], to_string(static_cast<ReduceOp>(row[3])),
          row[0] == mine[0] ? "" : " for another group (members or id)", to_string(send.dtype),
          send.numel, to_string(op)));
    }
  }

  // The ring of Communicator::partial_allreduce (lib/comm/partial_allreduce.cc:
  // the same chunks, steps and order of reduction, so the same bits), every
  // step enqueued on the stream and one wait at the end.
  void partial_allreduce_on_device(const DeviceRing& ring, const TensorView& send,
                                   const TensorView& recv, ReduceOp op) {
    using group_tags::chunk_of;
    const int m = ring.m();
    const std::int64_t n = recv.numel;
    const std::size_t element = dtype_size(recv.dtype);
    // Every chunk but (me + 1)'s in the reduce-scatter, every chunk but
    // (me + 2)'s in the allgather.
    count(static_cast<std::size_t>(2 * n - chunk_of(n, m, (ring.me + 1) % m).numel -
                                   chunk_of(n, m, (ring.me + 2) % m).numel) *
          element);
    CachingAllocator::Block scratch =
        cuda_device_pool(options_.device)
            .allocate(static_cast<std::size_t>(chunk_of(n, m, 0).numel) * element);
    try {
      run("partial_allreduce", {send}, {recv}, [&](const auto& in, const auto& out) {
        const TensorView& x = out[0];
        if (in[0].data != x.data) copy_async(x, in[0]);
        const TensorView incoming{scratch.data(), 0, x.dtype, x.device};
        for (int s = 0; s < m - 1; ++s) {  // reduce-scatter
          const auto mine = chunk_of(n, m, (ring.me - s + m) % m);
          const auto theirs = chunk_of(n, m, (ring.me - s - 1 + 2 * m) % m);
          exchange_with_neighbours(ring, x.slice(mine.offset, mine.numel),
                                   TensorView{incoming.data, theirs.numel, x.dtype, x.device});
          const TensorView target = x.slice(theirs.offset, theirs.numel);
          detail::check_launch(
              kernels::pairwise_reduce(target.data, target.data, incoming.data, theirs.numel,
                                       static_cast<int>(x.dtype), static_cast<int>(op), stream_),
              "partial_allreduce", target);
        }
        if (op == ReduceOp::kAvg) {
          const auto own = chunk_of(n, m, (ring.me + 1) % m);
          const TensorView target = x.slice(own.offset, own.numel);
          detail::check_launch(kernels::divide_inplace(target.data, own.numel,
                                                       static_cast<int>(x.dtype), m, stream_),
                               "partial_allreduce", target);
        }
        for (int s = 0; s < m - 1; ++s) {  // allgather
          const auto mine = chunk_of(n, m, (ring.me + 1 - s + m) % m);
          const auto theirs = chunk_of(n, m, (ring.me - s + m) % m);
          exchange_with_neighbours(ring, x.slice(mine.offset, mine.numel),
                                   x.slice(theirs.offset, theirs.numel));
        }
        return ncclSuccess;
      });
    } catch (...) {
      failed_staging_.push_back(std::move(scratch));  // the stream may still use it
      throw;
    }
  }

  // One ring step: `out` to the next member, `in` from the previous one.
  void exchange_with_neighbours(const DeviceRing& ring, const TensorView& out,
                                const TensorView& in) {
    Exchange exchange;
    exchange.sends.push_back({out, ring.next()});
    exchange.receives.push_back({in, ring.prev()});
    check_nccl(post("partial_allreduce", exchange), "ncclGroupEnd", "partial_allreduce");
  }

  std::unique_ptr<Communicator> make_group(std::span<const int> ranks, bool communication_stream) {
    const GroupSlot group = next_group(ranks);
    if (group.rank < 0) return nullptr;
    NcclOptions child = options_;
    child.prefix = fmt::format("{}/group{}", options_.prefix, group.number);
    child.communication_stream = communication_stream;
    return std::make_unique<NcclCommunicator>(store_, group.rank, static_cast<int>(ranks.size()),
                                              child);
  }

  // Enqueues `enqueue(device_inputs, device_outputs)` on the stream, with
  // host buffers staged through device scratch memory, then waits for the
  // stream within the timeout (aborting the communicator past it).
  template <typename Enqueue>
  void run(const char* op, const std::vector<TensorView>& inputs,
           const std::vector<TensorView>& outputs, Enqueue&& enqueue, bool copy_back = true) {
    if (aborted_.load()) {
      throw BackendError(
          fmt::format("{} on rank {}: the NCCL communicator was aborted", op, rank_));
    }
    check_cuda(cudaSetDevice(options_.device), "cudaSetDevice", op);
    // Host tensors are staged through blocks of the device pool, held until
    // the stream has finished with them: the wait at the end of this call, or
    // after a failure (the stream may still use them) the communicator's end.
    std::vector<CachingAllocator::Block> staging;
    try {
      stage_enqueue_wait(op, inputs, outputs, std::forward<Enqueue>(enqueue), copy_back, staging);
    } catch (...) {
      for (auto& block : staging) failed_staging_.push_back(std::move(block));
      throw;
    }
  }

  template <typename Enqueue>
  void stage_enqueue_wait(const char* op, const std::vector<TensorView>& inputs,
                          const std::vector<TensorView>& outputs, Enqueue&& enqueue, bool copy_back,
                          std::vector<CachingAllocator::Block>& staging) {
    const auto on_device = [&](const TensorView& v, bool copy_in) {
      if (v.device.type == DeviceType::kCUDA) return v;
      staging.push_back(cuda_device_pool(options_.device).allocate(v.nbytes()));
      void* d = staging.back().data();
      if (copy_in && v.nbytes() > 0) {
        check_cuda(cudaMemcpyAsync(d, v.data, v.nbytes(), cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpyAsync", op);
      }
      return TensorView{d, v.numel, v.dtype, Device{DeviceType::kCUDA, options_.device}};
    };
    std::vector<TensorView> d_in;
    std::vector<TensorView> d_out;
    d_in.reserve(inputs.size());
    d_out.reserve(outputs.size());
    for (const auto& v : inputs) d_in.push_back(on_device(v, true));
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      // An output that is also an input (in place) reuses the staged input.
      const auto same = std::find_if(inputs.begin(), inputs.end(), [&](const TensorView& v) {
        return v.data == outputs[i].data;
      });
      d_out.push_back(same != inputs.end() ? d_in[static_cast<std::size_t>(same - inputs.begin())]
                                           : on_device(outputs[i], false));
    }
    check_nccl(enqueue(d_in, d_out), op, op);
    if (copy_back) {
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        if (outputs[i].device.type != DeviceType::kCUDA && outputs[i].nbytes() > 0) {
          check_cuda(cudaMemcpyAsync(outputs[i].data, d_out[i].data, outputs[i].nbytes(),
                                     cudaMemcpyDeviceToHost, stream_),
                     "cudaMemcpyAsync", op);
        }
      }
    }
    wait_for_stream(op);
  }

  void copy_async(const TensorView& to, const TensorView& from) {
    check_cuda(
        cudaMemcpyAsync(to.data, from.data, from.nbytes(), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync", "copy");
  }

  // The shared timed stream wait; between polls NCCL's asynchronous error is
  // checked, and either failure aborts the communicator so peers blocked in
  // the same collective are released too.
  void wait_for_stream(const char* op) {
    try {
      cuda_stream_wait(stream_, options_.timeout, op, [&] {
        ncclResult_t async_error = ncclSuccess;
        lib_.comm_get_async_error(comm_, &async_error);
        if (async_error != ncclSuccess && async_error != ncclInProgress) {
          abort();
          throw BackendError(fmt::format("{} on rank {} of {}: NCCL failed: {}", op, rank_, size_,
                                         lib_.get_error_string(async_error)));
        }
      });
    } catch (const TimeoutError&) {
      abort();
      throw TimeoutError(fmt::format(
          "{} on rank {} of {} (group '{}', {}) timed out after {} ms; the NCCL communicator "
          "was aborted",
          op, rank_, size_, options_.prefix, backend_name(), options_.timeout.count()));
    }
  }

  // The error checks of lib/core/cuda_checks.h, naming the op and the rank
  // (formatted only on failure).
  void check_nccl(ncclResult_t result, const char* call, const char* op) const {
    if (result != ncclSuccess && result != ncclInProgress) {
      detail::throw_backend_error(where(op), call, lib_.get_error_string(result));
    }
  }
  void check_cuda(cudaError_t result, const char* call, const char* op) const {
    if (result != cudaSuccess)
      detail::throw_backend_error(where(op), call, cudaGetErrorString(result));
  }
  std::string where(const char* op) const {
    return fmt::format("{} on rank {} of {}", op, rank_, size_);
  }

  const NcclLibrary& lib_;
  std::shared_ptr<Store> store_;
  NcclOptions options_;
  int rank_;
  int size_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  Stream owned_stream_;  // a dedicated stream, else none
  int group_counter_ = 0;
  std::atomic<bool> aborted_{false};
  std::vector<CachingAllocator::Block> failed_staging_;  // see run()
};

}  // namespace

std::string nccl_unavailable_reason() {
  const auto& lib = NcclLibrary::get();
  if (!lib.error.empty()) return lib.error;
  if (cuda_device_count() == 0) return "no CUDA device is visible (or no CUDA driver)";
  return {};
}

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store> store, int rank,
                                                     int size, NcclOptions options) {
  BAGUA_CHECK_ARG(store != nullptr, "make_nccl_communicator: store is null");
  BAGUA_CHECK_ARG(size >= 1 && rank >= 0 && rank < size,
                  "make_nccl_communicator: rank {} / size {} is not a valid rank", rank, size);
  const std::string why = nccl_unavailable_reason();
  BAGUA_CHECK_ARG(why.empty(), "the NCCL backend is not available here: {}", why);
  return std::make_unique<NcclCommunicator>(std::move(store), rank, size, std::move(options));
}

}  // namespace bagua
