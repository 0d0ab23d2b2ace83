// compute_for: the one place that picks host loops or kernels for a device.
#include <memory>

#include "bagua/runtime/compute.h"
#include "bagua/runtime/cuda_compute.h"

namespace bagua {

std::unique_ptr<Compute> compute_for(Device device) {
  if (device.type == DeviceType::kCUDA) return make_cuda_compute(device.index);
  return std::make_unique<HostCompute>();
}

}  // namespace bagua
