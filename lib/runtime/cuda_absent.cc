// The CUDA entry points of a build made without CUDA (meson -Dcuda=disabled
// or no nvcc): the runtime reports no devices and stays on the CPU path.
#include "bagua/core/cuda_support.h"

namespace bagua {

bool cuda_compiled() noexcept { return false; }

int cuda_device_count() noexcept { return 0; }

void cuda_divide_inplace(const TensorView& x, std::int64_t /*divisor*/, void* /*stream*/) {
  throw InvalidArgument(
      "this build of bagua has no CUDA support (rebuild with nvcc available "
      "and -Dcuda=enabled); cannot process " +
      x.describe());
}

}  // namespace bagua
