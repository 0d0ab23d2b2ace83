// The CUDA entry points of a build with CUDA: thin checks around the kernel
// launchers, converting their status into the runtime's exceptions.
#include "bagua/core/cuda_support.h"

#include "bagua/core/compute.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "launchers.h"

namespace bagua {

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept { return kernels::device_count(); }

void cuda_divide_inplace(const TensorView& x, std::int64_t divisor, void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA,
                  "cuda_divide_inplace needs a CUDA tensor, got {}", x.describe());
  BAGUA_CHECK_ARG(divisor != 0, "cuda_divide_inplace: divisor is 0");
  if (const char* error =
          kernels::divide_inplace(x.data, x.numel, static_cast<int>(x.dtype), divisor, stream)) {
    throw BackendError("cuda_divide_inplace on " + x.describe() + ": " + error);
  }
}

void cuda_minmax_uint8_compress(const TensorView& x, std::int64_t chunk_elements, void* out,
                                void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA,
                  "cuda_minmax_uint8_compress needs a CUDA tensor, got {}", x.describe());
  BAGUA_CHECK_ARG(chunk_elements > 0, "chunk_elements must be positive, got {}", chunk_elements);
  if (const char* error = kernels::minmax_uint8_compress(x.data, x.numel, static_cast<int>(x.dtype),
                                                         chunk_elements, out, stream)) {
    throw BackendError("cuda_minmax_uint8_compress on " + x.describe() + ": " + error);
  }
}

void cuda_minmax_uint8_decompress(const void* in, std::int64_t chunk_elements,
                                  const TensorView& out, bool accumulate, void* stream) {
  BAGUA_CHECK_ARG(out.device.type == DeviceType::kCUDA,
                  "cuda_minmax_uint8_decompress needs a CUDA tensor, got {}", out.describe());
  BAGUA_CHECK_ARG(chunk_elements > 0, "chunk_elements must be positive, got {}", chunk_elements);
  if (const char* error =
          kernels::minmax_uint8_decompress(in, out.numel, static_cast<int>(out.dtype),
                                           chunk_elements, out.data, accumulate, stream)) {
    throw BackendError("cuda_minmax_uint8_decompress on " + out.describe() + ": " + error);
  }
}

void cuda_chunked_reduce(const TensorView& chunks, std::int64_t chunk_count, const TensorView& out,
                         bool mean, void* stream) {
  BAGUA_CHECK_ARG(chunks.device.type == DeviceType::kCUDA && out.device.type == DeviceType::kCUDA,
                  "cuda_chunked_reduce needs CUDA tensors, got {} and {}", chunks.describe(),
                  out.describe());
  BAGUA_CHECK_ARG(
      chunk_count > 0 && chunks.numel == chunk_count * out.numel && chunks.dtype == out.dtype,
      "cuda_chunked_reduce: {} is not {} chunks of {}", chunks.describe(), chunk_count,
      out.describe());
  if (const char* error =
          kernels::chunked_reduce(chunks.data, chunk_count, out.numel, static_cast<int>(out.dtype),
                                  mean, out.data, stream)) {
    throw BackendError("cuda_chunked_reduce on " + out.describe() + ": " + error);
  }
}

void cuda_async_average_update(const TensorView& w, const TensorView& sum,
                               const TensorView& snapshot, std::int64_t ranks, void* stream) {
  for (const auto* view : {&w, &sum, &snapshot}) {
    BAGUA_CHECK_ARG(
        view->device.type == DeviceType::kCUDA && view->numel == w.numel && view->dtype == w.dtype,
        "cuda_async_average_update: {} does not match {}", view->describe(), w.describe());
  }
  BAGUA_CHECK_ARG(ranks > 0, "cuda_async_average_update: ranks must be positive, got {}", ranks);
  if (const char* error = kernels::async_average_update(w.data, sum.data, snapshot.data, w.numel,
                                                        ranks, static_cast<int>(w.dtype), stream)) {
    throw BackendError("cuda_async_average_update on " + w.describe() + ": " + error);
  }
}

void cuda_synchronize() {
  if (kernels::synchronize_device() != 0) {
    throw BackendError("cuda_synchronize: a kernel or copy on the device failed");
  }
}

void* cuda_pinned_alloc(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  if (kernels::pinned_alloc(&pointer, bytes) != 0) {
    throw BackendError(fmt::format("cuda_pinned_alloc: cannot pin {} bytes of host memory", bytes));
  }
  return pointer;
}

void cuda_pinned_free(void* pointer) noexcept {
  if (pointer != nullptr) kernels::pinned_free(pointer);
}

void cuda_copy(void* destination, const void* source, std::size_t bytes) {
  if (kernels::copy(destination, source, bytes) != 0) {
    throw BackendError(fmt::format("cuda_copy of {} bytes failed", bytes));
  }
}

// --- Streams, events and pools ---------------------------------------------

namespace {

void check(cudaError_t status, std::string_view call, std::string_view what = {}) {
  if (status != cudaSuccess) {
    throw BackendError(fmt::format("{}{}{} failed: {}", what, what.empty() ? "" : ": ", call,
                                   cudaGetErrorString(status)));
  }
}

// Per-device singletons (streams, pools) for up to kMaxDevices GPUs, created
// on first use and never destroyed: ops holding pooled blocks may be freed
// during interpreter shutdown, after static destructors would have run.
constexpr int kMaxDevices = 64;

int checked_device(int device) {
  BAGUA_CHECK_ARG(device >= 0 && device < kMaxDevices && device < cuda_device_count(),
                  "CUDA device {} does not exist ({} visible)", device, cuda_device_count());
  return device;
}

template <typename T, typename Make>
T& per_device(std::array<std::unique_ptr<T>, kMaxDevices>& slots, int device, Make&& make) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  auto& slot = slots[static_cast<std::size_t>(checked_device(device))];
  if (!slot) slot = make();
  return *slot;
}

// Makes `device` current for a scope and restores the caller's device: the
// training thread calls in here (events are created on first mark) and must
// find PyTorch's current device unchanged.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Owns one stream; the stream outlives every user (destroyed at exit).
struct OwnedStream {
  void* stream = nullptr;
};

}  // namespace

void cuda_set_device(int device) { check(cudaSetDevice(checked_device(device)), "cudaSetDevice"); }

void* cuda_stream_create(int device) {
  const DeviceGuard guard(checked_device(device));
  int least = 0;
  int greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest),
        "cudaStreamCreateWithPriority");
  return stream;
}

void cuda_stream_destroy(void* stream) noexcept {
  if (stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void* cuda_communication_stream(int device) {
  static auto* streams = new std::array<std::unique_ptr<OwnedStream>, kMaxDevices>();
  return per_device(
             *streams, device,
             [&] { return std::make_unique<OwnedStream>(OwnedStream{cuda_stream_create(device)}); })
      .stream;
}

void cuda_stream_wait(void* stream, std::chrono::milliseconds timeout, std::string_view what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(5);
  while (true) {
    const cudaError_t state = cudaStreamQuery(static_cast<cudaStream_t>(stream));
    if (state == cudaSuccess) return;
    if (state != cudaErrorNotReady) check(state, "cudaStreamQuery", what);
    if (std::chrono::steady_clock::now() > deadline) {
      throw TimeoutError(
          fmt::format("{}: the device work did not finish within {} ms", what, timeout.count()));
    }
    // Short waits stay responsive; long ones back off to spare the CPU.
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
}

void* cuda_event_create(int device) {
  const DeviceGuard guard(checked_device(device));
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return event;
}

void cuda_event_destroy(void* event) noexcept {
  if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void cuda_event_record(void* event, void* stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
}

void cuda_stream_wait_event(void* stream, void* event) {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

EventPool& cuda_event_pool(int device) {
  static auto* pools = new std::array<std::unique_ptr<EventPool>, kMaxDevices>();
  return per_device(*pools, device, [&] {
    return std::make_unique<EventPool>([device] { return cuda_event_create(device); },
                                       [](void* event) { cuda_event_destroy(event); });
  });
}

CachingAllocator& cuda_device_pool(int device) {
  static auto* pools = new std::array<std::unique_ptr<CachingAllocator>, kMaxDevices>();
  return per_device(*pools, device, [&] {
    return std::make_unique<CachingAllocator>(
        fmt::format("cuda:{} scratch pool", device),
        [device](std::size_t bytes) {
          const DeviceGuard guard(device);
          void* pointer = nullptr;
          check(cudaMalloc(&pointer, bytes), "cudaMalloc");
          return pointer;
        },
        [](void* pointer) { cudaFree(pointer); });
  });
}

CachingAllocator& pinned_host_pool() {
  // Never destroyed: blocks may be returned during static destruction.
  static auto* pool = new CachingAllocator(
      "pinned host pool", [](std::size_t bytes) { return cuda_pinned_alloc(bytes); },
      [](void* pointer) { cuda_pinned_free(pointer); });
  return *pool;
}

void cuda_copy_async(void* destination, const void* source, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault,
                        static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync");
}

void cuda_zero_async(void* destination, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(destination, 0, bytes, static_cast<cudaStream_t>(stream)),
        "cudaMemsetAsync");
}

void cuda_axpby(double a, const TensorView& x, double b, const TensorView& y, void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA && y.device.type == DeviceType::kCUDA &&
                      x.numel == y.numel && x.dtype == y.dtype && is_floating_point(x.dtype),
                  "cuda_axpby needs two CUDA tensors of one floating dtype and size, got {} and {}",
                  x.describe(), y.describe());
  if (const char* error =
          kernels::axpby(a, x.data, b, y.data, y.numel, static_cast<int>(y.dtype), stream)) {
    throw BackendError("cuda_axpby on " + y.describe() + ": " + error);
  }
}

void cuda_ring_diff(const TensorView& x, const TensorView& w, const TensorView& l,
                    const TensorView& r, const TensorView& diff, void* stream) {
  for (const auto* view : {&w, &l, &r}) {
    BAGUA_CHECK_ARG(view->device == x.device && view->numel == x.numel && view->dtype == x.dtype,
                    "cuda_ring_diff: {} does not match {}", view->describe(), x.describe());
  }
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA && diff.device == x.device &&
                      diff.numel == x.numel && diff.dtype == DType::kFloat32,
                  "cuda_ring_diff: diff {} for {}", diff.describe(), x.describe());
  if (const char* error =
          kernels::ring_diff(x.data, w.data, l.data, r.data, static_cast<float*>(diff.data),
                             x.numel, static_cast<int>(x.dtype), stream)) {
    throw BackendError("cuda_ring_diff on " + x.describe() + ": " + error);
  }
}

void cuda_convert(const TensorView& from, const TensorView& to, void* stream) {
  BAGUA_CHECK_ARG(from.device.type == DeviceType::kCUDA && to.device.type == DeviceType::kCUDA &&
                      from.numel == to.numel,
                  "cuda_convert needs two CUDA tensors of one size, got {} and {}", from.describe(),
                  to.describe());
  if (const char* error = kernels::convert(from.data, static_cast<int>(from.dtype), to.data,
                                           static_cast<int>(to.dtype), to.numel, stream)) {
    throw BackendError("cuda_convert to " + to.describe() + ": " + error);
  }
}

// --- Compute on the device ---------------------------------------------------

namespace {

class CudaCompute final : public Compute {
 public:
  CudaCompute(int device, void* stream)
      : device_(device), stream_(stream != nullptr ? stream : cuda_communication_stream(device)) {}

  Device device() const override { return Device{DeviceType::kCUDA, device_}; }

  CachingAllocator::Block scratch(std::size_t bytes) override {
    return cuda_device_pool(device_).allocate(bytes);
  }
  // Each call makes the compute's device current for its launch only: the
  // caller may be the training thread, whose current device stays PyTorch's.
  void copy(void* destination, const void* source, std::size_t bytes) override {
    const DeviceGuard guard(device_);
    cuda_copy_async(destination, source, bytes, stream_);
  }
  void zero(void* destination, std::size_t bytes) override {
    const DeviceGuard guard(device_);
    cuda_zero_async(destination, bytes, stream_);
  }
  void convert(const TensorView& from, const TensorView& to) override {
    if (from.dtype == to.dtype) {
      copy(to.data, from.data, to.nbytes());
      return;
    }
    const DeviceGuard guard(device_);
    cuda_convert(from, to, stream_);
  }
  void compress(const TensorView& x, std::int64_t chunk_elements, std::byte* out) override {
    const DeviceGuard guard(device_);
    cuda_minmax_uint8_compress(x, chunk_elements, out, stream_);
  }
  void decompress(const std::byte* in, std::int64_t chunk_elements, const TensorView& out,
                  bool accumulate) override {
    const DeviceGuard guard(device_);
    cuda_minmax_uint8_decompress(in, chunk_elements, out, accumulate, stream_);
  }
  void divide(const TensorView& x, std::int64_t divisor) override {
    const DeviceGuard guard(device_);
    cuda_divide_inplace(x, divisor, stream_);
  }
  void axpby(double a, const TensorView& x, double b, const TensorView& y) override {
    const DeviceGuard guard(device_);
    cuda_axpby(a, x, b, y, stream_);
  }
  void async_update(const TensorView& w, const TensorView& sum, const TensorView& snapshot,
                    std::int64_t ranks) override {
    const DeviceGuard guard(device_);
    cuda_async_average_update(w, sum, snapshot, ranks, stream_);
  }
  void ring_diff(const TensorView& x, const TensorView& w, const TensorView& l, const TensorView& r,
                 const TensorView& diff) override {
    const DeviceGuard guard(device_);
    cuda_ring_diff(x, w, l, r, diff, stream_);
  }
  void finish(std::string_view what, std::chrono::milliseconds timeout) override {
    cuda_stream_wait(stream_, timeout, what);
  }

 private:
  int device_;
  void* stream_;
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(int device, void* stream) {
  return std::make_unique<CudaCompute>(checked_device(device), stream);
}

}  // namespace bagua
