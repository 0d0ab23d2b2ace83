// The ops' kernel wrappers of bagua/ops/op_steps.h in a build without CUDA:
// an InvalidArgument saying why (CPU buckets never reach them).
#include "bagua/core/errors.h"
#include "bagua/ops/op_steps.h"

namespace bagua {
namespace {

[[noreturn]] void no_cuda(const TensorView& x) {
  throw InvalidArgument("this build of bagua has no CUDA support; cannot process " + x.describe());
}

}  // namespace

void cuda_async_average_update(const TensorView& w, const TensorView& /*sum*/,
                               const TensorView& /*snapshot*/, std::int64_t /*ranks*/,
                               void* /*stream*/) {
  no_cuda(w);
}

void cuda_async_average_drift(const TensorView& sum, const TensorView& /*snapshot*/,
                              std::int64_t /*ranks*/, double* /*d_out*/, void* /*stream*/) {
  no_cuda(sum);
}

void cuda_low_precision_ring_diff(const TensorView& x, const TensorView& /*w*/,
                                  const TensorView& /*l*/, const TensorView& /*r*/,
                                  const TensorView& /*diff*/, void* /*stream*/) {
  no_cuda(x);
}

}  // namespace bagua
