// bagua/core/cuda.h in a build with CUDA: thin wrappers over the CUDA
// runtime, every call checked (core/cuda_checks.h), and the per-device
// singletons (communication streams, pools) sized by the device count.
#include "bagua/core/cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "core/cuda_checks.h"

namespace bagua {
namespace {

// One T per visible device, created on first use. Instances are never
// destroyed (see cuda.h: blocks and events may come back during shutdown).
template <typename T>
class PerDevice {
 public:
  template <typename Make>
  T& get(int device, Make&& make) {
    std::lock_guard lock(mutex_);
    if (slots_.empty()) slots_.resize(static_cast<std::size_t>(cuda_device_count()));
    auto& slot = slots_[static_cast<std::size_t>(detail::checked_device(device))];
    if (!slot) slot = make();
    return *slot;
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<T>> slots_;
};

void* create_stream(int device) {
  const DeviceGuard guard(device);
  int least = 0;
  int greatest = 0;
  detail::check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                     "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  detail::check_cuda(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest),
                     "cudaStreamCreateWithPriority");
  return stream;
}

void* create_event(int device) {
  const DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  detail::check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags");
  return event;
}

}  // namespace

namespace detail {

int checked_device(int device) {
  const int count = cuda_device_count();
  BAGUA_CHECK_ARG(device >= 0 && device < count, "CUDA device {} does not exist ({} visible)",
                  device, count);
  return device;
}

}  // namespace detail

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the "no driver" error so later calls start clean
    return 0;
  }
  return count;
}

DeviceGuard::DeviceGuard(int device) {
  detail::check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    detail::check_cuda(cudaSetDevice(detail::checked_device(device)), "cudaSetDevice");
  }
}

DeviceGuard::~DeviceGuard() { cudaSetDevice(previous_); }

namespace detail {

void destroy_stream(void* handle) noexcept {
  if (handle != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(handle));
}

void destroy_event(void* handle) noexcept {
  if (handle != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(handle));
}

}  // namespace detail

Stream::Stream(int device) : UniqueHandle(create_stream(device)) {}

Event::Event(int device) : UniqueHandle(create_event(device)) {}

void* cuda_communication_stream(int device) {
  static auto* streams = new PerDevice<Stream>();
  return streams->get(device, [&] { return std::make_unique<Stream>(device); }).get();
}

void cuda_stream_wait(void* stream, std::chrono::milliseconds timeout, std::string_view what,
                      const std::function<void()>& between_polls) {
  // Polls without sleeping for the first kSpin: Linux sleeps at least ~50 us
  // whatever is asked (timer slack), which would add that much to every
  // short collective (measured on an H100: a 1 MiB world-1 NCCL copy took
  // 71 us instead of 11). Longer waits back off to spare the CPU.
  constexpr auto kSpin = std::chrono::microseconds(200);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  auto pause = std::chrono::microseconds(20);
  while (true) {
    const cudaError_t state = cudaStreamQuery(static_cast<cudaStream_t>(stream));
    if (state == cudaSuccess) return;
    if (state != cudaErrorNotReady) detail::check_cuda(state, "cudaStreamQuery", what);
    if (between_polls) between_polls();
    const auto now = std::chrono::steady_clock::now();
    if (now > deadline) {
      throw TimeoutError(
          fmt::format("{}: the device work did not finish within {} ms", what, timeout.count()));
    }
    if (now - start < kSpin) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
}

void cuda_event_record(void* event, void* stream) {
  detail::check_cuda(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
      "cudaEventRecord");
}

void cuda_stream_wait_event(void* stream, void* event) {
  detail::check_cuda(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
      "cudaStreamWaitEvent");
}

void cuda_copy_async(void* destination, const void* source, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  detail::check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault,
                                     static_cast<cudaStream_t>(stream)),
                     "cudaMemcpyAsync");
}

EventPool& cuda_event_pool(int device) {
  static auto* pools = new PerDevice<EventPool>();
  return pools->get(device, [&] {
    return std::make_unique<EventPool>([device] { return Event(device).release(); },
                                       &detail::destroy_event);
  });
}

CachingAllocator& cuda_device_pool(int device) {
  static auto* pools = new PerDevice<CachingAllocator>();
  return pools->get(device, [&] {
    return std::make_unique<CachingAllocator>(
        fmt::format("cuda:{} scratch pool", device),
        [device](std::size_t bytes) {
          const DeviceGuard guard(device);
          void* pointer = nullptr;
          detail::check_cuda(cudaMalloc(&pointer, bytes), "cudaMalloc");
          return pointer;
        },
        [](void* pointer) { cudaFree(pointer); });
  });
}

CachingAllocator& pinned_host_pool() {
  static auto* pool = new CachingAllocator(
      "pinned host pool",
      [](std::size_t bytes) {
        void* pointer = nullptr;
        detail::check_cuda(cudaMallocHost(&pointer, bytes),
                           fmt::format("cudaMallocHost of {} bytes", bytes));
        return pointer;
      },
      [](void* pointer) { cudaFreeHost(pointer); });
  return *pool;
}

}  // namespace bagua
