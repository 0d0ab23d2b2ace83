// bagua/core/cuda.h in a build without CUDA (meson -Dcuda=disabled or no
// nvcc): no devices, so the runtime stays on the CPU path; anything that
// needs a device is an InvalidArgument saying why.
#include <fmt/format.h>

#include "bagua/core/cuda.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace {

[[noreturn]] void no_device(int device) {
  throw InvalidArgument(fmt::format(
      "CUDA device {} does not exist: this build of bagua has no CUDA support (rebuild with nvcc "
      "available and -Dcuda=enabled)",
      device));
}

[[noreturn]] void no_cuda(std::string_view call) {
  throw InvalidArgument(fmt::format("{}: this build of bagua has no CUDA support", call));
}

}  // namespace

bool cuda_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

DeviceGuard::DeviceGuard(int device) { no_device(device); }
DeviceGuard::~DeviceGuard() = default;
Stream::Stream(int device) { no_device(device); }
Event::Event(int device) { no_device(device); }
void detail::destroy_stream(void* /*handle*/) noexcept {}
void detail::destroy_event(void* /*handle*/) noexcept {}

void* cuda_communication_stream(int device) { no_device(device); }
void cuda_stream_wait(void* /*stream*/, std::chrono::milliseconds /*timeout*/,
                      std::string_view /*what*/, const std::function<void()>& /*between_polls*/) {
  no_cuda("cuda_stream_wait");
}
void cuda_event_record(void* /*event*/, void* /*stream*/) { no_cuda("cuda_event_record"); }
void cuda_stream_wait_event(void* /*stream*/, void* /*event*/) {
  no_cuda("cuda_stream_wait_event");
}
void cuda_copy_async(void* /*destination*/, const void* /*source*/, std::size_t /*bytes*/,
                     void* /*stream*/) {
  no_cuda("cuda_copy_async");
}
EventPool& cuda_event_pool(int device) { no_device(device); }
CachingAllocator& cuda_device_pool(int device) { no_device(device); }

CachingAllocator& pinned_host_pool() {
  static auto* pool = new CachingAllocator(
      "host staging pool", [](std::size_t bytes) { return ::operator new(bytes); },
      [](void* pointer) { ::operator delete(pointer); });
  return *pool;
}

}  // namespace bagua
