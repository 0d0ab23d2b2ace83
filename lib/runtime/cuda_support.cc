// The CUDA entry points of a build with CUDA: thin checks around the kernel
// launchers, converting their status into the runtime's exceptions.
#include "bagua/core/cuda_support.h"

#include <string>

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

}  // namespace bagua
