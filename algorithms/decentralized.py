"""Decentralized algorithms: ranks average their weights with peers instead of
all-reducing gradients.

``DecentralizedAlgorithm``: in full precision, with all ranks, one partner
(shift_one) or both ring neighbours; the exchange starts when forward starts
and overlaps with forward and backward; the averaged weights are adopted
after backward, before the optimizer step (D_FP_S).

``LowPrecisionDecentralizedAlgorithm``: after each optimizer step every rank
exchanges the 8-bit compressed change of its weights with its two ring
neighbours (D_LP_S) and moves to the average of the three.
"""

from typing import Dict, List, Tuple

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl

__all__ = ["DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "LowPrecisionDecentralizedAlgorithm",
           "LowPrecisionDecentralizedAlgorithmImpl"]


def _check_interval(name: str, communication_interval) -> None:
    if not isinstance(communication_interval, int) or isinstance(communication_interval, bool) \
            or communication_interval < 1:
        raise InvalidArgumentError(
            f"{name}: communication_interval must be an integer >= 1, got {communication_interval!r}")


def weight_tensors(bagua_ddp) -> List:
    """Each trainable parameter's weights (``param.data``) as a BaguaTensor."""
    tensors = []
    for name, param in reversed(bagua_ddp.bagua_build_params()):
        tensors.append(param.ensure_bagua_tensor(
            name, bagua_ddp.bagua_module_name,
            getter_closure=lambda p: p.data,
            setter_closure=lambda p, t: setattr(p, "data", t)))
    return tensors


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        # bucket name -> (weight, left peer weight, right peer weight)
        self.peer_weights: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def init_tensors(self, bagua_ddp) -> List:
        # Re-bucketing (autotune, profiling): keep each tensor's copies of its
        # own and its neighbours' weights, they are state of the algorithm.
        self._saved_copies = {}
        for bucket in bagua_ddp.bagua_buckets:
            copies = self.peer_weights.get(bucket.name)
            if copies is None:
                continue
            offset = 0
            for tensor in bucket.tensors:
                n = tensor.bagua_registered_tensor().numel()
                self._saved_copies[tensor.name] = tuple(c[offset:offset + n].clone() for c in copies)
                offset += n
        self.peer_weights = {}
        return weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        saved = getattr(self, "_saved_copies", {})
        if all(t.name in saved for t in bucket.tensors):
            weight, left, right = (torch.cat([saved[t.name][i] for t in bucket.tensors]) for i in range(3))
        else:
            flat = torch.cat([t.bagua_registered_tensor().detach().reshape(-1) for t in bucket.tensors])
            weight, left, right = flat.clone(), flat.clone(), flat.clone()
        self.peer_weights[bucket.name] = (weight, left, right)
        bucket.append_low_precision_decentralized_synchronous_op(
            weight, left, right, hierarchical=self.hierarchical, compression="MinMaxUInt8",
            group=self.process_group)

    def _should_communicate(self, bagua_ddp) -> bool:
        return (bagua_ddp.step_counter - 1) % self.communication_interval == 0

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            pass  # weights, not gradients, are communicated

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            pass

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if self._should_communicate(bagua_ddp):
                bagua_ddp.mark_unready_tensors()
                bagua_ddp.wait_pending_comm_ops()

        return hook


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        """
        Args:
            hierarchical: average inside each node in full precision first; the
                ring runs among node leaders.
            communication_interval: communicate every this many steps (on steps
                1, 1 + k, 1 + 2k, ...).
        """
        if not isinstance(hierarchical, bool):
            raise InvalidArgumentError(
                f"LowPrecisionDecentralizedAlgorithm: hierarchical must be True or False, got {hierarchical!r}")
        _check_interval("LowPrecisionDecentralizedAlgorithm", communication_interval)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, process_group) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(process_group, self.hierarchical,
                                                      self.communication_interval)


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval
        self.ops = {}  # bucket name -> DecentralizedSynchronousOp
        self.peer_weights = {}  # bucket name -> flat tensor the op averages into
        self.communicated_steps = []  # steps on which weights were exchanged

    def init_tensors(self, bagua_ddp) -> List:
        return weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        flat = torch.cat([t.bagua_registered_tensor().detach().reshape(-1) for t in bucket.tensors])
        self.peer_weights[bucket.name] = flat.clone()
        self.ops[bucket.name] = bucket.append_decentralized_synchronous_op(
            self.peer_weights[bucket.name], hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode, group=self.process_group)

    def _should_communicate(self, bagua_ddp) -> bool:
        return (bagua_ddp.step_counter - 1) % self.communication_interval == 0

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            # Start the exchange now: it overlaps with forward and backward,
            # which only read the weights.
            if self._should_communicate(bagua_ddp):
                bagua_ddp.mark_unready_tensors()

        return hook

    def init_backward_hook(self, bagua_ddp):
        def hook(parameter_name, parameter):
            pass

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            if self._should_communicate(bagua_ddp):
                bagua_ddp.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    self.ops[bucket.name].copy_back_peer_weight(bucket)
                self.communicated_steps.append(bagua_ddp.step_counter)

        return hook


class DecentralizedAlgorithm(Algorithm):
    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1):
        """
        Args:
            hierarchical: average inside each node first; the exchange runs
                among node leaders.
            peer_selection_mode: "all" (global average), "shift_one" (one
                partner per step, changing every step; with an odd number of
                ranks one rank sits each step out) or "ring" (both ring
                neighbours, weights 1/3).
            communication_interval: exchange every this many steps (on steps
                1, 1 + k, 1 + 2k, ...).
        """
        if not isinstance(hierarchical, bool):
            raise InvalidArgumentError(
                f"DecentralizedAlgorithm: hierarchical must be True or False, got {hierarchical!r}")
        if peer_selection_mode not in ("all", "shift_one", "ring"):
            raise InvalidArgumentError(
                "DecentralizedAlgorithm: peer_selection_mode must be 'all', 'shift_one' or 'ring', "
                f"got {peer_selection_mode!r}")
        _check_interval("DecentralizedAlgorithm", communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(process_group, self.hierarchical, self.peer_selection_mode,
                                          self.communication_interval)
