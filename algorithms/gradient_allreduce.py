"""Gradient AllReduce: the data-parallel baseline, equal to PyTorch DDP.

Every gradient is averaged (or summed) over all ranks with C_FP_S while
backward still runs; all ranks then take the same optimizer step.
"""

from typing import Union

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks
from bagua.torch_api.algorithms.hierarchy_choice import HierarchyChoice

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: Union[bool, str] = "auto", average: bool = True):
        super().__init__(process_group)
        self.hierarchy = HierarchyChoice(hierarchical, process_group)
        self.average = average

    @property
    def hierarchical(self) -> bool:
        """The form of the buckets' ops from the next step on."""
        return self.hierarchy.hierarchical

    @hierarchical.setter
    def hierarchical(self, setting: Union[bool, str]) -> None:
        # Algorithms written for Bagua subclass this impl and set the
        # attribute: a value fixes the form (or measures again, "auto").
        self.hierarchy = HierarchyChoice(setting, self.process_group)

    def need_reset(self) -> bool:
        return self.hierarchy.take_switch()

    def init_forward_pre_hook(self, bagua_ddp):
        inner = super().init_forward_pre_hook(bagua_ddp)

        def hook(inputs):
            self.hierarchy.step_started()
            inner(inputs)
        return hook

    def init_post_backward_hook(self, bagua_ddp):
        inner = super().init_post_backward_hook(bagua_ddp)

        def hook():
            inner()
            self.hierarchy.step_communicated()
        return hook

    def state_dict(self, bagua_ddp) -> dict:
        return self.hierarchy.state_dict()

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        self.hierarchy.load_state_dict(state)

    def reduces_sparse_gradients(self) -> bool:
        return True  # averaged exactly, as DDP: indices and values (data_parallel.sparse)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group)


class GradientAllReduceAlgorithm(Algorithm):
    impl_class = GradientAllReduceAlgorithmImpl

    def __init__(self, hierarchical: Union[bool, str] = "auto", average: bool = True):
        """
        Args:
            hierarchical: ``True``: sum inside each node first (through
                shared memory), then each rank reduces its share of the
                node's sum with the same share on the other nodes (nodes from
                LOCAL_WORLD_SIZE; with nodes of unequal size the node leaders
                reduce it all), and the node gathers the shares; a host's
                bytes cross the network once instead of once per rank.
                ``False``: Bagua's flat allreduce among all ranks. Over one
                node, or with one rank per node, both are the flat allreduce.
                ``"auto"`` (the default): across nodes of several ranks, the
                first steps time both forms and the faster one runs from
                then on (algorithms/hierarchy_choice.py; it is in
                ``model.bagua_ddp.bagua_algorithm_impl.hierarchy.decision``).
            average: average the gradients (True) or sum them (False).
        """
        if not (isinstance(hierarchical, bool) or hierarchical == "auto"):
            raise InvalidArgumentError(f"{type(self).__name__}: hierarchical must be True, False or 'auto', "
                                       f"got {hierarchical!r}")
        ArgumentChecks(type(self).__name__).flags(average=average)
        self.keep_settings(hierarchical=hierarchical, average=average)
