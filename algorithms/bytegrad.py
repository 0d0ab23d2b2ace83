"""ByteGrad: gradient averaging with 8-bit compression (C_LP_S).

Each bucket of gradients is averaged with the paper's compressed
scatter-reduce: MinMaxUInt8 chunks, alltoall, reduce, compress, allgather.
About a quarter of GradientAllReduce's bytes for fp32 gradients.
"""

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, check_flags

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]


class ByteGradAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, average: bool = True):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, scattergather=True,
            compression="MinMaxUInt8", group=self.process_group)


class ByteGradAlgorithm(Algorithm):
    def __init__(self, hierarchical: bool = True, average: bool = True):
        """
        Args:
            hierarchical: average inside each node in full precision first and
                compress only between nodes (nodes from LOCAL_WORLD_SIZE).
            average: average (True) or sum (False) the gradients.
        """
        check_flags("ByteGradAlgorithm", hierarchical=hierarchical, average=average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(process_group, self.hierarchical, self.average)
