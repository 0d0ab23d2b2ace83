// The NCCL backend. See bagua/comm/nccl_communicator.h for the contract.
//
// NCCL's functions come from dlopen("libnccl.so.2") through one table
// (NcclLibrary), typed from nccl.h's own declarations. Every NCCL and CUDA
// call goes through check(), which turns a failure into BackendError naming
// the call, the op and the rank.
#include "bagua/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "core/cuda_checks.h"

namespace bagua {
namespace {

struct NcclLibrary {
  void* handle = nullptr;
  std::string error;
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;

  static const NcclLibrary& get() {
    static const NcclLibrary library = [] {
      NcclLibrary lib;
      lib.handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
      if (lib.handle == nullptr) lib.handle = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
      if (lib.handle == nullptr) {
        const char* why = dlerror();
        lib.error = std::string("cannot load libnccl.so.2: ") + (why ? why : "unknown error");
        return lib;
      }
      const auto bind = [&](auto& slot, const char* name) {
        slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(lib.handle, name));
        if (slot == nullptr && lib.error.empty()) lib.error = std::string("libnccl lacks ") + name;
      };
      bind(lib.get_version, "ncclGetVersion");
      bind(lib.get_unique_id, "ncclGetUniqueId");
      bind(lib.comm_init_rank, "ncclCommInitRank");
      bind(lib.comm_destroy, "ncclCommDestroy");
      bind(lib.comm_abort, "ncclCommAbort");
      bind(lib.comm_get_async_error, "ncclCommGetAsyncError");
      bind(lib.get_error_string, "ncclGetErrorString");
      bind(lib.all_reduce, "ncclAllReduce");
      bind(lib.reduce, "ncclReduce");
      bind(lib.broadcast, "ncclBroadcast");
      bind(lib.all_gather, "ncclAllGather");
      bind(lib.reduce_scatter, "ncclReduceScatter");
      bind(lib.send, "ncclSend");
      bind(lib.recv, "ncclRecv");
      bind(lib.group_start, "ncclGroupStart");
      bind(lib.group_end, "ncclGroupEnd");
      return lib;
    }();
    return library;
  }
};

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
  }
  throw InternalError("nccl_type: unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return ncclProd;
  }
  throw InternalError("nccl_op: unknown op");
}

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
    for (void* p : scratch_) cudaFree(p);
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

  void allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    same_shape("allreduce", send, recv);
    if (send.numel == 0) return;
    count(recv.nbytes() * 2 * static_cast<std::size_t>(size_ - 1) /
          static_cast<std::size_t>(size_));
    run("allreduce", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.all_reduce(in[0].data, out[0].data, static_cast<std::size_t>(send.numel),
                             nccl_type(send.dtype), nccl_op(op), comm_, stream_);
    });
  }

  void reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) override {
    check_root("reduce", root);
    if (send.numel == 0) return;
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

  void broadcast(const TensorView& buffer, int root) override {
    check_root("broadcast", root);
    if (buffer.numel == 0) return;
    count(buffer.nbytes());
    run("broadcast", {buffer}, {buffer}, [&](const auto& in, const auto& out) {
      return lib_.broadcast(in[0].data, out[0].data, static_cast<std::size_t>(buffer.numel),
                            nccl_type(buffer.dtype), root, comm_, stream_);
    });
  }

  void allgather(const TensorView& send, const TensorView& recv) override {
    gathered_shape("allgather", send, recv);
    if (send.numel == 0) return;
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1));
    run("allgather", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.all_gather(in[0].data, out[0].data, static_cast<std::size_t>(send.numel),
                             nccl_type(send.dtype), comm_, stream_);
    });
  }

  void gather(const TensorView& send, const TensorView& recv, int root) override {
    check_root("gather", root);
    if (rank_ == root) gathered_shape("gather", send, recv);
    if (send.numel == 0) return;
    count(send.nbytes());
    const TensorView target = rank_ == root ? recv : send;
    run(
        "gather", {send}, {target},
        [&](const auto& in, const auto& out) {
          return grouped([&] {
            if (rank_ == root) {
              for (int r = 0; r < size_; ++r) {
                const auto chunk = out[0].slice(r * send.numel, send.numel);
                if (r == root) {
                  copy_async(chunk, in[0]);
                } else {
                  check_nccl(lib_.recv(chunk.data, static_cast<std::size_t>(send.numel),
                                       nccl_type(send.dtype), r, comm_, stream_),
                             "ncclRecv", "gather");
                }
              }
            } else {
              check_nccl(lib_.send(in[0].data, static_cast<std::size_t>(send.numel),
                                   nccl_type(send.dtype), root, comm_, stream_),
                         "ncclSend", "gather");
            }
          });
        },
        /*copy_back=*/rank_ == root);
  }

  void scatter(const TensorView& send, const TensorView& recv, int root) override {
    check_root("scatter", root);
    if (rank_ == root) gathered_shape("scatter", recv, send);
    if (recv.numel == 0) return;
    count(recv.nbytes());
    const TensorView source = rank_ == root ? send : recv;
    run("scatter", {source}, {recv}, [&](const auto& in, const auto& out) {
      return grouped([&] {
        if (rank_ == root) {
          for (int r = 0; r < size_; ++r) {
            const auto chunk = in[0].slice(r * recv.numel, recv.numel);
            if (r == root) {
              copy_async(out[0], chunk);
            } else {
              check_nccl(lib_.send(chunk.data, static_cast<std::size_t>(recv.numel),
                                   nccl_type(recv.dtype), r, comm_, stream_),
                         "ncclSend", "scatter");
            }
          }
        } else {
          check_nccl(lib_.recv(out[0].data, static_cast<std::size_t>(recv.numel),
                               nccl_type(recv.dtype), root, comm_, stream_),
                     "ncclRecv", "scatter");
        }
      });
    });
  }

  void reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override {
    gathered_shape("reduce_scatter", recv, send);
    if (recv.numel == 0) return;
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1) / static_cast<std::size_t>(size_));
    run("reduce_scatter", {send}, {recv}, [&](const auto& in, const auto& out) {
      return lib_.reduce_scatter(in[0].data, out[0].data, static_cast<std::size_t>(recv.numel),
                                 nccl_type(recv.dtype), nccl_op(op), comm_, stream_);
    });
  }

  void alltoall(const TensorView& send, const TensorView& recv) override {
    same_shape("alltoall", send, recv);
    BAGUA_CHECK_ARG(send.numel % size_ == 0,
                    "alltoall on rank {}: {} elements do not split into {} equal chunks", rank_,
                    send.numel, size_);
    if (send.numel == 0) return;
    const std::int64_t chunk = send.numel / size_;
    count(send.nbytes() * static_cast<std::size_t>(size_ - 1) / static_cast<std::size_t>(size_));
    run("alltoall", {send}, {recv}, [&](const auto& in, const auto& out) {
      return grouped([&] {
        for (int r = 0; r < size_; ++r) {
          const auto from = in[0].slice(r * chunk, chunk);
          const auto to = out[0].slice(r * chunk, chunk);
          if (r == rank_) {
            copy_async(to, from);
            continue;
          }
          check_nccl(lib_.send(from.data, static_cast<std::size_t>(chunk), nccl_type(send.dtype), r,
                               comm_, stream_),
                     "ncclSend", "alltoall");
          check_nccl(lib_.recv(to.data, static_cast<std::size_t>(chunk), nccl_type(send.dtype), r,
                               comm_, stream_),
                     "ncclRecv", "alltoall");
        }
      });
    });
  }

  void send(const TensorView& buffer, int peer) override {
    const PeerMessage sends[] = {{buffer, peer}};
    send_recv(sends, {});
  }

  void recv(const TensorView& buffer, int peer) override {
    const PeerMessage receives[] = {{buffer, peer}};
    send_recv({}, receives);
  }

  void send_recv(std::span<const PeerMessage> sends,
                 std::span<const PeerMessage> receives) override {
    std::vector<TensorView> in;
    std::vector<TensorView> out;
    for (const auto& m : sends) {
      check_peer("send_recv", m.peer);
      in.push_back(m.buffer);
      count(m.buffer.nbytes());
    }
    for (const auto& m : receives) {
      check_peer("send_recv", m.peer);
      out.push_back(m.buffer);
    }
    run("send_recv", in, out, [&](const auto& d_in, const auto& d_out) {
      return grouped([&] {
        for (std::size_t i = 0; i < sends.size(); ++i) {
          check_nccl(lib_.send(d_in[i].data, static_cast<std::size_t>(d_in[i].numel),
                               nccl_type(d_in[i].dtype), sends[i].peer, comm_, stream_),
                     "ncclSend", "send_recv");
        }
        for (std::size_t i = 0; i < receives.size(); ++i) {
          check_nccl(lib_.recv(d_out[i].data, static_cast<std::size_t>(d_out[i].numel),
                               nccl_type(d_out[i].dtype), receives[i].peer, comm_, stream_),
                     "ncclRecv", "send_recv");
        }
      });
    });
  }

  void barrier() override {
    std::int32_t token = 0;
    const TensorView view{&token, 1, DType::kInt32, {}};
    allreduce(view, view, ReduceOp::kSum);
  }

  void abort() noexcept override {
    if (!aborted_.exchange(true) && comm_ != nullptr) lib_.comm_abort(comm_);
  }

  std::unique_ptr<Communicator> new_group(std::span<const int> ranks) override {
    return make_group(ranks, options_.communication_stream);
  }
  std::unique_ptr<Communicator> new_bucket_group(std::span<const int> ranks) override {
    return make_group(ranks, true);
  }

 private:
  std::unique_ptr<Communicator> make_group(std::span<const int> ranks, bool communication_stream) {
    BAGUA_CHECK_ARG(!ranks.empty(), "new_group: the rank list is empty");
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      BAGUA_CHECK_ARG(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]),
                      "new_group: ranks must be sorted, unique and below {}", size_);
    }
    const std::string prefix = fmt::format("{}/group{}", options_.prefix, group_counter_++);
    const auto found = std::find(ranks.begin(), ranks.end(), rank_);
    if (found == ranks.end()) return nullptr;
    NcclOptions child = options_;
    child.prefix = prefix;
    child.communication_stream = communication_stream;
    return std::make_unique<NcclCommunicator>(store_, static_cast<int>(found - ranks.begin()),
                                              static_cast<int>(ranks.size()), child);
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
    std::size_t next_scratch = 0;
    const auto on_device = [&](const TensorView& v, bool copy_in) {
      if (v.device.type == DeviceType::kCUDA) return v;
      void* d = scratch(next_scratch++, v.nbytes());
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

  template <typename Body>
  ncclResult_t grouped(Body&& body) {
    check_nccl(lib_.group_start(), "ncclGroupStart", "group");
    body();
    return lib_.group_end();
  }

  void copy_async(const TensorView& to, const TensorView& from) {
    check_cuda(
        cudaMemcpyAsync(to.data, from.data, from.nbytes(), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync", "copy");
  }

  void wait_for_stream(const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (true) {
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) check_cuda(state, "cudaStreamQuery", op);
      ncclResult_t async_error = ncclSuccess;
      lib_.comm_get_async_error(comm_, &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        abort();
        throw BackendError(fmt::format("{} on rank {} of {}: NCCL failed: {}", op, rank_, size_,
                                       lib_.get_error_string(async_error)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        throw TimeoutError(fmt::format(
            "{} on rank {} of {} (group '{}', {}) timed out after {} ms; the NCCL communicator "
            "was aborted",
            op, rank_, size_, options_.prefix, backend_name(), options_.timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void* scratch(std::size_t index, std::size_t bytes) {
    if (scratch_.size() <= index) {
      scratch_.resize(index + 1, nullptr);
      scratch_bytes_.resize(index + 1, 0);
    }
    if (scratch_bytes_[index] < bytes) {
      if (scratch_[index] != nullptr) cudaFree(scratch_[index]);
      check_cuda(cudaMalloc(&scratch_[index], bytes), "cudaMalloc", "staging");
      scratch_bytes_[index] = bytes;
    }
    return scratch_[index];
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
  void check_root(const char* op, int root) const {
    BAGUA_CHECK_ARG(root >= 0 && root < size_, "{}: root {} is outside the group of size {}", op,
                    root, size_);
  }
  void check_peer(const char* op, int peer) const {
    BAGUA_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_,
                    "{} on rank {}: peer {} is not another rank of the group of size {}", op, rank_,
                    peer, size_);
  }
  static void same_shape(const char* op, const TensorView& a, const TensorView& b) {
    BAGUA_CHECK_ARG(a.numel == b.numel && a.dtype == b.dtype, "{}: input {} and output {} differ",
                    op, a.describe(), b.describe());
  }
  void gathered_shape(const char* op, const TensorView& part, const TensorView& whole) const {
    BAGUA_CHECK_ARG(part.dtype == whole.dtype && whole.numel == part.numel * size_,
                    "{}: expected a buffer of {} x {}, got {}", op, size_, part.describe(),
                    whole.describe());
  }
  void count(std::size_t bytes) {
    counters_.bytes_sent += static_cast<std::int64_t>(bytes);
    counters_.bytes_received += static_cast<std::int64_t>(bytes);
    counters_.calls += 1;
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
  std::vector<void*> scratch_;
  std::vector<std::size_t> scratch_bytes_;
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
