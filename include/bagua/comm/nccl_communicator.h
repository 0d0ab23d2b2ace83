// Factory of the NCCL backend: CUDA tensors, one rank per GPU.
//
// NCCL is loaded at run time (dlopen of libnccl.so.2), so the library and the
// Python module load on machines without NCCL or without a GPU;
// `nccl_available()` says whether this backend can be used here. The NCCL
// headers stay in lib/comm/nccl_communicator.cc.
//
// Contract, beyond Communicator's: collectives are enqueued on the
// communicator's own high-priority stream and each call returns once that
// stream has finished them (so host-side completion means the data is
// ready). A call that does not finish within the timeout aborts the NCCL
// communicator (ncclCommAbort) and throws TimeoutError: a dead peer becomes
// an error, not a hang. Host (CPU) buffers are staged through device memory.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "bagua/comm/communicator.h"
#include "bagua/comm/store.h"

namespace bagua {

struct NcclOptions {
  // Keys of this communicator (the NCCL unique id) live under this prefix.
  std::string prefix = "bagua";
  // The CUDA device of this rank.
  int device = 0;
  // Bound on every wait; zero means BAGUA_COMM_TIMEOUT_S.
  std::chrono::milliseconds timeout{0};
  // True: collectives run on the device's communication stream, ordered with
  // the comm ops' kernels and ready-event waits (bagua/core/cuda.h); for the
  // buckets' communicator and its subgroups (new_bucket_group). False: on a
  // stream of its own, so calls from other threads (user collectives, the
  // asynchronous model average's) never queue behind, and deadlock with,
  // the buckets' collectives.
  bool communication_stream = false;
};

// Why NCCL cannot be used here, or an empty string when it can.
std::string nccl_unavailable_reason();
inline bool nccl_available() { return nccl_unavailable_reason().empty(); }

// Collective over the `size` ranks sharing `store`.
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Store> store, int rank,
                                                     int size, NcclOptions options = {});

}  // namespace bagua
