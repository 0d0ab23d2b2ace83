// The one family of checks that turns CUDA and NCCL failures into the
// runtime's exceptions at the boundary, shared by the CUDA code (lib/core,
// lib/runtime, lib/ops) and the NCCL backend (lib/comm). Every message reads
// "<context>: <call> failed: <reason>": the context names where (the op and
// rank, the tensor), the call what failed, the reason what CUDA or NCCL said.
//
// Lib-internal: it includes the CUDA runtime header, which interface headers
// never do. Compiled only when CUDA is (the *_absent.cc files need none of it).
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"

namespace bagua::detail {

[[noreturn]] inline void throw_backend_error(std::string_view context, std::string_view call,
                                             std::string_view reason) {
  throw BackendError(
      fmt::format("{}{}{} failed: {}", context, context.empty() ? "" : ": ", call, reason));
}

// The status of a CUDA runtime call named `call`.
inline void check_cuda(cudaError_t status, std::string_view call, std::string_view context = {}) {
  if (status != cudaSuccess) throw_backend_error(context, call, cudaGetErrorString(status));
}

// The status of a kernel launcher (kernels/launchers.h: nullptr, or what went
// wrong) called by `wrapper` on `target`.
inline void check_launch(const char* error, std::string_view wrapper, const TensorView& target) {
  if (error != nullptr) {
    throw_backend_error(fmt::format("{} on {}", wrapper, target.describe()), "the kernel", error);
  }
}

// `device` when it names a visible CUDA device, else an InvalidArgument
// (lib/core/cuda.cc).
int checked_device(int device);

}  // namespace bagua::detail
