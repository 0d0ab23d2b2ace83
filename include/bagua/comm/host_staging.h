// Host staging: CUDA buffers for a communicator that only reaches host
// memory (Gloo). Every CUDA buffer of a call is copied to a pinned host
// buffer before the call and, for outputs, back to the device after it; host
// buffers pass through untouched. This is also how several processes share
// one GPU: NCCL refuses two ranks on one device, Gloo over staged buffers
// does not mind.
//
// The copies run on the device's communication stream, so they start after
// the device work already enqueued there (a comm op's compression kernels,
// the waits on the tensors' ready events), and the host waits for them
// (within the communicator's timeout) before the transfer and before the
// call returns: results are on the device when the call returns, like the
// NCCL backend's. Host buffers are pinned blocks from pinned_host_pool(),
// reused from call to call.
#pragma once

#include <memory>

#include "bagua/comm/communicator.h"

namespace bagua {

// Wraps `inner` (which must reach host memory); subgroups stay wrapped.
std::unique_ptr<Communicator> with_host_staging(std::unique_ptr<Communicator> inner);

}  // namespace bagua
