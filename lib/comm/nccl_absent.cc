// The NCCL entry points of a build without CUDA: NCCL is never available.
#include "bagua/comm/nccl_communicator.h"
#include "bagua/core/errors.h"

namespace bagua {

std::string nccl_unavailable_reason() {
  return "this build of bagua has no CUDA support (rebuild with nvcc available)";
}

// The signature is the header's, by-value parameters included.
// NOLINTBEGIN(performance-unnecessary-value-param)
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store> /*store*/, int /*rank*/,
                                                     int /*size*/, NcclOptions /*options*/) {
  throw InvalidArgument("the NCCL backend is not available: " + nccl_unavailable_reason());
}
// NOLINTEND(performance-unnecessary-value-param)

}  // namespace bagua
