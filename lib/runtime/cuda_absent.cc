// The CUDA entry points of a build made without CUDA (meson -Dcuda=disabled
// or no nvcc): the runtime reports no devices and stays on the CPU path.
#include "bagua/core/cuda_support.h"

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

}  // namespace bagua
