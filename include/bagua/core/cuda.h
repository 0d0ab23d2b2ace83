// CUDA at run time: whether this build has it, how many devices there are,
// RAII device guards, streams and events, and the per-device pools of the
// communication path. Kernels are not here: Compute runs them
// (bagua/runtime/cuda_compute.h).
//
// The same binary runs with or without a GPU: when CUDA was compiled in
// (meson option `cuda`) the library links the static CUDA runtime, and
// `cuda_device_count()` asks the driver, returning 0 (never throwing or
// aborting) when there is no driver or no device. Callers take the CPU path
// whenever it returns 0. Without CUDA in the build (lib/core/cuda_absent.cc)
// every device call is an InvalidArgument saying so.
//
// Streams and events cross this interface as handles (void*: a cudaStream_t
// or a cudaEvent_t; a null stream is the legacy default stream), so no
// interface header needs a CUDA header. Errors of CUDA calls are
// BackendErrors naming the call (lib/core/cuda_checks.h).
//
// The communication stream: all of bagua's device work on one GPU runs on
// one stream, the ready-event waits, the comm ops' kernels, the copies of
// host staging and the collectives of the NCCL communicators (except a
// dedicated communicator that asks for a stream of its own). One stream
// orders them without host round trips; it is created once per device with
// the highest priority, non-blocking with respect to the legacy default
// stream, so communication is not queued behind the training kernels.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string_view>
#include <utility>

#include "bagua/core/caching_allocator.h"
#include "bagua/core/event_pool.h"

namespace bagua {

// True when this build contains the CUDA kernels.
bool cuda_compiled() noexcept;

// Number of usable CUDA devices; 0 without a GPU, a driver, or a CUDA build.
int cuda_device_count() noexcept;

// Makes `device` current for a scope and restores the caller's device: the
// training thread calls into the runtime and must find PyTorch's current
// device unchanged. InvalidArgument for a device that does not exist.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

namespace detail {

void destroy_stream(void* handle) noexcept;
void destroy_event(void* handle) noexcept;

// A move-only owner of one CUDA handle, given back with `Destroy`.
template <void (*Destroy)(void*) noexcept>
class UniqueHandle {
 public:
  UniqueHandle() = default;  // no handle
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { reset(); }

  void* get() const { return handle_; }
  void reset() noexcept { Destroy(std::exchange(handle_, nullptr)); }
  // Gives the handle up: the caller destroys it.
  void* release() { return std::exchange(handle_, nullptr); }

 protected:
  explicit UniqueHandle(void* handle) : handle_(handle) {}

 private:
  void* handle_ = nullptr;
};

}  // namespace detail

// An owned stream of one device: the highest priority, non-blocking with
// respect to the legacy default stream. Move-only; destroyed with the
// object (after the work enqueued on it, as cudaStreamDestroy does).
class Stream : public detail::UniqueHandle<&detail::destroy_stream> {
 public:
  Stream() = default;  // no stream
  explicit Stream(int device);
};

// An owned event of one device, timing disabled. Move-only.
class Event : public detail::UniqueHandle<&detail::destroy_event> {
 public:
  Event() = default;  // no event
  explicit Event(int device);
};

// The communication stream of `device`, created on first use and kept for
// the process.
void* cuda_communication_stream(int device);

// The host waits until the work enqueued on `stream` so far is done. Past
// `timeout` a TimeoutError names `what`; a failed kernel is a BackendError.
// Only that stream is waited for, never the whole device. `between_polls`,
// if given, runs after each unfinished poll (a communicator checks its
// asynchronous errors there, and throws to end the wait).
void cuda_stream_wait(void* stream, std::chrono::milliseconds timeout, std::string_view what,
                      const std::function<void()>& between_polls = {});

// `event` records the work enqueued on `stream` so far; then `stream` (any
// other) waits on the device for that work, the host does not wait.
void cuda_event_record(void* event, void* stream);
void cuda_stream_wait_event(void* stream, void* event);

// Asynchronous copy (any direction: cudaMemcpyDefault) on `stream`.
void cuda_copy_async(void* destination, const void* source, std::size_t bytes, void* stream);

// Pools, one per device (as many as cuda_device_count() reports), created on
// first use and kept for the process: ops holding pooled blocks may be freed
// during interpreter shutdown, after static destructors would have run.
EventPool& cuda_event_pool(int device);
CachingAllocator& cuda_device_pool(int device);
// Page-locked host memory for staging (ordinary memory without CUDA).
CachingAllocator& pinned_host_pool();

}  // namespace bagua
