// Lib-internal: NCCL's functions, loaded with dlopen("libnccl.so.2") into
// one table typed from nccl.h's own declarations (so the library links and
// loads where NCCL is absent), and the mapping of our dtypes and reduce ops
// to NCCL's. Used by nccl_communicator.cc.
#pragma once

#include <nccl.h>

#include <string>

#include "bagua/core/dtype.h"
#include "bagua/core/reduce_op.h"

namespace bagua {

struct NcclLibrary {
  void* handle = nullptr;
  std::string error;
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;

  // The process's one table, loaded at the first call; `error` says why
  // it is unusable (no libnccl, a missing symbol), empty when it is usable.
  static const NcclLibrary& get();
};

ncclDataType_t nccl_type(DType dtype);
ncclRedOp_t nccl_op(ReduceOp op);

}  // namespace bagua
