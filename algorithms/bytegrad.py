"""ByteGrad and Float16Grad: gradient averaging in fewer bytes.

GradientAllReduce with one difference each:
- ByteGrad (C_LP_S): each bucket of gradients is averaged with the paper's
  compressed scatter-reduce (MinMaxUInt8 chunks, alltoall, reduce,
  compress, allgather), about a quarter of the bytes for fp32;
- Float16Grad (C_HP_S, Bagua's ``"floatgrad"``): each bucket is converted to
  float16, divided by the world size, allreduced (sum) in float16 and
  converted back, as PyTorch DDP's ``fp16_compress_hook`` does; half the
  bytes for fp32. float16 gradients are averaged in place; bfloat16 ones are
  refused (InvalidArgumentError: float16 would save nothing and cut their
  range), integer buckets too.
"""

from bagua.torch_api.algorithms.gradient_allreduce import (
    GradientAllReduceAlgorithm,
    GradientAllReduceAlgorithmImpl,
)

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl", "Float16GradAlgorithm", "Float16GradAlgorithmImpl"]


class ByteGradAlgorithmImpl(GradientAllReduceAlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, scattergather=True,
            compression="MinMaxUInt8", group=self.process_group)


class ByteGradAlgorithm(GradientAllReduceAlgorithm):
    impl_class = ByteGradAlgorithmImpl

    def __init__(self, hierarchical: bool = True, average: bool = True):
        """
        Args:
            hierarchical: average inside each node in full precision first and
                compress only between nodes (nodes from LOCAL_WORLD_SIZE).
            average: average (True) or sum (False) the gradients.
        """
        super().__init__(hierarchical=hierarchical, average=average)


class Float16GradAlgorithmImpl(GradientAllReduceAlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, compression="Float16",
            group=self.process_group)


class Float16GradAlgorithm(GradientAllReduceAlgorithm):
    impl_class = Float16GradAlgorithmImpl

    def __init__(self, hierarchical: bool = True, average: bool = True):
        """
        Args:
            hierarchical: sum inside each node first (in float16), then among
                the node leaders, broadcast back inside the node (nodes from
                LOCAL_WORLD_SIZE).
            average: divide by the world size before the float16 sum, as
                DDP's fp16_compress_hook (True), or only sum (False).
        """
        super().__init__(hierarchical=hierarchical, average=average)
