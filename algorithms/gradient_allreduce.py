"""Gradient AllReduce: the data-parallel baseline, equal to PyTorch DDP.

Every gradient is averaged (or summed) over all ranks with C_FP_S while
backward still runs; all ranks then take the same optimizer step.
"""

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, average: bool = True):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def reduces_sparse_gradients(self) -> bool:
        return True  # averaged exactly, as DDP: indices and values (data_parallel.sparse)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group)


class GradientAllReduceAlgorithm(Algorithm):
    impl_class = GradientAllReduceAlgorithmImpl

    def __init__(self, hierarchical: bool = True, average: bool = True):
        """
        Args:
            hierarchical: sum inside each node first (through shared memory),
                then each rank reduces its share of the node's sum with the
                same share on the other nodes (nodes from LOCAL_WORLD_SIZE;
                with nodes of unequal size the node leaders reduce it all),
                and the node gathers the shares. Over one
                node, or with one rank per node, it runs the flat allreduce
                (the same sum, fewer passes), so the default costs nothing
                there; across hosts of several ranks it sends a host's bytes
                once instead of once per rank (Bagua's default is False:
                docs/benchmarks.md, "Across hosts").
            average: average the gradients (True) or sum them (False).
        """
        ArgumentChecks(type(self).__name__).flags(hierarchical=hierarchical, average=average)
        self.keep_settings(hierarchical=hierarchical, average=average)
