// NCCL loaded at run time; see comm/nccl_library.h.
#include "comm/nccl_library.h"

#include <dlfcn.h>

#include <type_traits>

#include "bagua/core/errors.h"

namespace bagua {

const NcclLibrary& NcclLibrary::get() {
  static const NcclLibrary library = [] {
    NcclLibrary lib;
    lib.handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib.handle == nullptr) lib.handle = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib.handle == nullptr) {
      const char* why = dlerror();
      lib.error = std::string("cannot load libnccl.so.2: ") + (why ? why : "unknown error");
      return lib;
    }
    const auto bind = [&](auto& slot, const char* name) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(lib.handle, name));
      if (slot == nullptr && lib.error.empty()) lib.error = std::string("libnccl lacks ") + name;
    };
    bind(lib.get_version, "ncclGetVersion");
    bind(lib.get_unique_id, "ncclGetUniqueId");
    bind(lib.comm_init_rank, "ncclCommInitRank");
    bind(lib.comm_destroy, "ncclCommDestroy");
    bind(lib.comm_abort, "ncclCommAbort");
    bind(lib.comm_get_async_error, "ncclCommGetAsyncError");
    bind(lib.get_error_string, "ncclGetErrorString");
    bind(lib.all_reduce, "ncclAllReduce");
    bind(lib.reduce, "ncclReduce");
    bind(lib.broadcast, "ncclBroadcast");
    bind(lib.all_gather, "ncclAllGather");
    bind(lib.reduce_scatter, "ncclReduceScatter");
    bind(lib.send, "ncclSend");
    bind(lib.recv, "ncclRecv");
    bind(lib.group_start, "ncclGroupStart");
    bind(lib.group_end, "ncclGroupEnd");
    return lib;
  }();
  return library;
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
  }
  throw InternalError("nccl_type: unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return ncclProd;
  }
  throw InternalError("nccl_op: unknown op");
}

}  // namespace bagua
