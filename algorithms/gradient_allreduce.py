"""Gradient AllReduce: the data-parallel baseline, equal to PyTorch DDP.

Every gradient is averaged (or summed) over all ranks with C_FP_S while
backward still runs; all ranks then take the same optimizer step.
"""

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, check_flags

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = False, average: bool = True):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group)


class GradientAllReduceAlgorithm(Algorithm):
    def __init__(self, hierarchical: bool = False, average: bool = True):
        """
        Args:
            hierarchical: reduce inside each node first, communicate among
                node leaders (nodes from LOCAL_WORLD_SIZE), broadcast back.
            average: average the gradients (True) or sum them (False).
        """
        check_flags(type(self).__name__, hierarchical=hierarchical, average=average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, self.hierarchical, self.average)
