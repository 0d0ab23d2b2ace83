// C_HP_S: centralized, half precision, synchronous (Float16Grad's
// primitive; PyTorch DDP's fp16_compress_hook as a bucket op).
//
// Every rank ends with the sum or average of the bucket over all ranks,
// communicated as IEEE float16 (half of fp32's bytes, a quarter of fp64's).
// The steps and roundings are the hook's (buffer.to(float16).div_(n),
// all_reduce(sum), buffer.copy_(result)):
//   1. h = float16(x), round to nearest even (beyond +-65504: +-inf);
//   2. when averaging, h = float16(float(h) / n), n the global world size:
//      the division comes before the sum, which then stays in range;
//   3. h = the float16 sum of h over the ranks, each addition done in float
//      and rounded to float16 (the communicators' rule for 16-bit floats,
//      Gloo's and NCCL's);
//   4. x = float(h), exact.
// With two ranks the result has the hook's bits; with more the collective
// picks the order of the additions, so the last bits may differ.
// Hierarchical: the node sums its float16 copies into its leader, the
// leaders sum among themselves, the node receives the leader's sum, all in
// float16 and with the division first as above.
//
// Bucket dtypes: float32 and float64 are converted through a float16 copy;
// float16 is divided and summed in place (the hook's steps without the
// conversions). bfloat16 is refused: it is 16 bits already, so float16
// would save no bytes and cut its range to +-65504 (use C_FP_S, i.e.
// compression=None). Integers are refused.
//
// Threading: as CommOp (the communication thread, one op at a time).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct CentralizedHalfPrecisionOptions {
  bool hierarchical = false;
  bool average = true;
};

class CentralizedHalfPrecisionOp final : public HierarchicalOp {
 public:
  // `dtype` is the bucket's; `hierarchy` is required when
  // options.hierarchical is set.
  CentralizedHalfPrecisionOp(std::shared_ptr<Communicator> global,
                             std::shared_ptr<HierarchicalComms> hierarchy, DType dtype,
                             CentralizedHalfPrecisionOptions options)
      : HierarchicalOp("C_HP_S", std::move(global), hierarchy,
                       worth_two_levels(options.hierarchical, hierarchy)),
        options_(options) {
    check_float16_communicable(dtype);
  }

  std::string_view name() const override { return "centralized_half_precision"; }

  void execute(Bucket& bucket) override {
    for_flat_bucket(bucket, [&](const TensorView& data) {
      if (data.numel == 0) return;  // every rank's bucket has the same size
      Compute& c = compute();
      const Float16Work half = float16_work(c, data);
      if (options_.average) c.divide(half.view, global().size());
      reduce_across(half.view, false, [](Communicator& comm, const TensorView& h, bool) {
        comm.allreduce(h, h, ReduceOp::kSum);
      });
      if (half.is_copy()) c.convert(half.view, data);
    });
  }

 private:
  static void check_float16_communicable(DType dtype) {
    constexpr std::string_view op =
        "C_HP_S (append_centralized_synchronous_op(compression='Float16'))";
    BAGUA_CHECK_ARG(dtype != DType::kBFloat16,
                    "{}: the bucket is bfloat16, 16 bits already: float16 would save no bytes "
                    "and cut its range to +-65504; communicate it as bfloat16 with "
                    "compression=None (GradientAllReduceAlgorithm)",
                    op);
    BAGUA_CHECK_ARG(is_floating_point(dtype),
                    "{}: float16 communicates float32, float64 or float16 buckets, got {}", op,
                    to_string(dtype));
  }

  // A float16 version of `data` to communicate: `data` itself when it is
  // float16, else a float16 copy in c's scratch memory (`block` holds it),
  // which execute() converts back into `data`.
  struct Float16Work {
    CachingAllocator::Block block;
    TensorView view;
    bool is_copy() const { return block.data() != nullptr; }
  };
  static Float16Work float16_work(Compute& c, const TensorView& data) {
    if (data.dtype == DType::kFloat16) return {{}, data};
    Float16Work work{c.scratch(static_cast<std::size_t>(data.numel) * dtype_size(DType::kFloat16)),
                     {}};
    work.view = c.view(work.block, data.numel, DType::kFloat16);
    c.convert(data, work.view);
    return work;
  }

  CentralizedHalfPrecisionOptions options_;
};

}  // namespace bagua
