// Host staging: CUDA buffers for a communicator that only reaches host
// memory (Gloo). Every CUDA buffer of a call is copied to a pinned host
// buffer before the call and, for outputs, back to the device after it; host
// buffers pass through untouched. This is also how several processes share
// one GPU: NCCL refuses two ranks on one device, Gloo over staged buffers
// does not mind.
//
// The copies are synchronous (they finish before the call returns), so the
// results are on the device when the call returns, like the NCCL backend's.
#pragma once

#include <memory>

#include "bagua/comm/communicator.h"

namespace bagua {

// Wraps `inner` (which must reach host memory); subgroups stay wrapped.
std::unique_ptr<Communicator> with_host_staging(std::unique_ptr<Communicator> inner);

}  // namespace bagua
