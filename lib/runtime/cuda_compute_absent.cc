// bagua/runtime/cuda_compute.h in a build without CUDA: there is no device
// to compute on, so every entry point is an InvalidArgument saying why.
#include <fmt/format.h>

#include "bagua/core/errors.h"
#include "bagua/runtime/cuda_compute.h"

namespace bagua {
namespace {

[[noreturn]] void no_cuda(const TensorView& x) {
  throw InvalidArgument(
      "this build of bagua has no CUDA support (rebuild with nvcc available and "
      "-Dcuda=enabled); cannot process " +
      x.describe());
}

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(int device, void* /*stream*/) {
  throw InvalidArgument(fmt::format(
      "cuda:{}: this build of bagua has no CUDA support (rebuild with nvcc available)", device));
}

void cuda_divide_inplace(const TensorView& x, std::int64_t /*divisor*/, void* /*stream*/) {
  no_cuda(x);
}

void cuda_minmax_uint8_compress(const TensorView& x, std::int64_t /*chunk_elements*/, void* /*out*/,
                                void* /*stream*/) {
  no_cuda(x);
}

void cuda_minmax_uint8_decompress(const void* /*in*/, std::int64_t /*chunk_elements*/,
                                  const TensorView& out, bool /*accumulate*/, void* /*stream*/) {
  no_cuda(out);
}

void cuda_chunked_reduce(const TensorView& /*chunks*/, std::int64_t /*chunk_count*/,
                         const TensorView& out, bool /*mean*/, void* /*stream*/) {
  no_cuda(out);
}

void cuda_pairwise_reduce(ReduceOp /*op*/, const TensorView& out, const TensorView& /*a*/,
                          const TensorView& /*b*/, void* /*stream*/) {
  no_cuda(out);
}

}  // namespace bagua
