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

}  // namespace bagua
