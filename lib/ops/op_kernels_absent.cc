// The ops' kernel wrappers of bagua/ops/op_steps.h in a build without CUDA:
// an InvalidArgument saying why (CPU buckets never reach them).
#include "bagua/core/errors.h"
#include "bagua/ops/low_rank_steps.h"
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

void cuda_low_rank_project(LowRankShape /*s*/, const TensorView& m, const TensorView& /*error*/,
                           const TensorView& /*q*/, const TensorView& /*p*/, void* /*stream*/) {
  no_cuda(m);
}

void cuda_low_rank_project_back(LowRankShape /*s*/, const TensorView& m, const TensorView& /*p*/,
                                const TensorView& /*accumulator*/, const TensorView& /*q*/,
                                void* /*stream*/) {
  no_cuda(m);
}

void cuda_low_rank_reconstruct(LowRankShape /*s*/, const TensorView& m, const TensorView& /*error*/,
                               const TensorView& /*p*/, const TensorView& /*q*/, void* /*stream*/) {
  no_cuda(m);
}

void cuda_orthogonalize_columns(LowRankShape /*s*/, const TensorView& p, double /*epsilon*/,
                                void* /*stream*/) {
  no_cuda(p);
}

}  // namespace bagua
