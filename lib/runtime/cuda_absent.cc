// The CUDA entry points of a build made without CUDA (meson -Dcuda=disabled
// or no nvcc): the runtime reports no devices and stays on the CPU path.
#include "bagua/core/cuda_support.h"

#include "bagua/core/compute.h"

namespace bagua {
namespace {

[[noreturn]] void no_cuda(const TensorView& x) {
  throw InvalidArgument(
      "this build of bagua has no CUDA support (rebuild with nvcc available and "
      "-Dcuda=enabled); cannot process " +
      x.describe());
}

}  // namespace

bool cuda_compiled() noexcept { return false; }

int cuda_device_count() noexcept { return 0; }

void cuda_divide_inplace(const TensorView& x, std::int64_t /*divisor*/, void* /*stream*/) {
  no_cuda(x);
}

void cuda_minmax_uint8_compress(const TensorView& x, std::int64_t /*chunk_elements*/, void* /*out*/,
                                void* /*stream*/) {
  no_cuda(x);
}

void cuda_minmax_uint8_decompress(const void* /*in*/, std::int64_t /*chunk_elements*/,
                                  const TensorView& out, bool /*accumulate*/, void* /*stream*/) {
  no_cuda(out);
}

void cuda_chunked_reduce(const TensorView& /*chunks*/, std::int64_t /*chunk_count*/,
                         const TensorView& out, bool /*mean*/, void* /*stream*/) {
  no_cuda(out);
}

void cuda_async_average_update(const TensorView& w, const TensorView& /*sum*/,
                               const TensorView& /*snapshot*/, std::int64_t /*ranks*/,
                               void* /*stream*/) {
  no_cuda(w);
}

void cuda_synchronize() { throw InvalidArgument("this build of bagua has no CUDA support"); }

void* cuda_pinned_alloc(std::size_t bytes) { return bytes == 0 ? nullptr : ::operator new(bytes); }

void cuda_pinned_free(void* pointer) noexcept { ::operator delete(pointer); }

void cuda_copy(void* /*destination*/, const void* /*source*/, std::size_t /*bytes*/) {
  throw InvalidArgument("this build of bagua has no CUDA support: no device memory to copy");
}

namespace {

[[noreturn]] void no_cuda(std::string_view call) {
  throw InvalidArgument(fmt::format("{}: this build of bagua has no CUDA support", call));
}

}  // namespace

void cuda_set_device(int /*device*/) { no_cuda("cuda_set_device"); }
void* cuda_communication_stream(int /*device*/) { no_cuda("cuda_communication_stream"); }
void* cuda_stream_create(int /*device*/) { no_cuda("cuda_stream_create"); }
void cuda_stream_destroy(void* /*stream*/) noexcept {}
void cuda_stream_wait(void* /*stream*/, std::chrono::milliseconds /*timeout*/,
                      std::string_view /*what*/) {
  no_cuda("cuda_stream_wait");
}
void* cuda_event_create(int /*device*/) { no_cuda("cuda_event_create"); }
void cuda_event_destroy(void* /*event*/) noexcept {}
void cuda_event_record(void* /*event*/, void* /*stream*/) { no_cuda("cuda_event_record"); }
void cuda_stream_wait_event(void* /*stream*/, void* /*event*/) {
  no_cuda("cuda_stream_wait_event");
}
EventPool& cuda_event_pool(int /*device*/) { no_cuda("cuda_event_pool"); }
CachingAllocator& cuda_device_pool(int /*device*/) { no_cuda("cuda_device_pool"); }

CachingAllocator& pinned_host_pool() {
  static auto* pool = new CachingAllocator(
      "host staging pool", [](std::size_t bytes) { return ::operator new(bytes); },
      [](void* pointer) { ::operator delete(pointer); });
  return *pool;
}

void cuda_copy_async(void* /*destination*/, const void* /*source*/, std::size_t /*bytes*/,
                     void* /*stream*/) {
  no_cuda("cuda_copy_async");
}
void cuda_zero_async(void* /*destination*/, std::size_t /*bytes*/, void* /*stream*/) {
  no_cuda("cuda_zero_async");
}
void cuda_axpby(double /*a*/, const TensorView& /*x*/, double /*b*/, const TensorView& y,
                void* /*stream*/) {
  no_cuda(y);
}
void cuda_ring_diff(const TensorView& x, const TensorView& /*w*/, const TensorView& /*l*/,
                    const TensorView& /*r*/, const TensorView& /*diff*/, void* /*stream*/) {
  no_cuda(x);
}
void cuda_convert(const TensorView& /*from*/, const TensorView& to, void* /*stream*/) {
  no_cuda(to);
}

std::unique_ptr<Compute> make_cuda_compute(int device, void* /*stream*/) {
  throw InvalidArgument(fmt::format(
      "cuda:{}: this build of bagua has no CUDA support (rebuild with nvcc available)", device));
}

}  // namespace bagua
