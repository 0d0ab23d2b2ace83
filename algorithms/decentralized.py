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

from bagua.torch_api.algorithms.base import (
    Algorithm,
    AlgorithmImpl,
    check_choice,
    check_flags,
    check_integer,
    do_nothing,
    is_communication_step,
    weight_tensors,
)

__all__ = ["DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "LowPrecisionDecentralizedAlgorithm",
           "LowPrecisionDecentralizedAlgorithmImpl"]

PEER_SELECTION_MODES = ("all", "shift_one", "ring")


def _flat_weights(bucket) -> torch.Tensor:
    """A flat copy of the bucket's weights, the starting value of an op's copies."""
    return torch.cat([t.bagua_registered_tensor().detach().reshape(-1) for t in bucket.tensors])


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        # bucket name -> (weight, left peer weight, right peer weight)
        self.peer_weights: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # tensor name -> its slices of the copies, kept across re-bucketing
        self._saved_copies: Dict[str, Tuple[torch.Tensor, ...]] = {}
        # the same, from a checkpoint, adopted at the next re-bucketing
        self._loaded_copies: Dict[str, Tuple[torch.Tensor, ...]] = {}

    def _copies_by_tensor(self, bagua_ddp) -> Dict[str, Tuple[torch.Tensor, ...]]:
        """Each bucketed tensor's slices of (weight, left, right), cloned."""
        copies_by_tensor = {}
        for bucket in bagua_ddp.bagua_buckets:
            copies = self.peer_weights.get(bucket.name)
            if copies is None:
                continue
            offset = 0
            for tensor in bucket.tensors:
                n = tensor.bagua_registered_tensor().numel()
                copies_by_tensor[tensor.bagua_tensor_name] = tuple(c[offset:offset + n].clone() for c in copies)
                offset += n
        return copies_by_tensor

    def init_tensors(self, bagua_ddp) -> List:
        # Re-bucketing (autotune, profiling, a loaded checkpoint): keep each
        # tensor's copies of its own and its neighbours' weights, they are
        # state of the algorithm.
        self._saved_copies = self._copies_by_tensor(bagua_ddp)
        self._saved_copies.update(self._loaded_copies)
        self._loaded_copies = {}
        self.peer_weights = {}
        return weight_tensors(bagua_ddp)

    def state_dict(self, bagua_ddp) -> dict:
        return {"peer_weights": self._copies_by_tensor(bagua_ddp)}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        self._loaded_copies = dict(state["peer_weights"])

    def ranks_share_weights(self) -> bool:
        return False

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        saved = self._saved_copies
        if all(t.bagua_tensor_name in saved for t in bucket.tensors):
            weight, left, right = (torch.cat([saved[t.bagua_tensor_name][i] for t in bucket.tensors])
                                   .to(bucket.device) for i in range(3))
        else:
            flat = _flat_weights(bucket)
            weight, left, right = flat.clone(), flat.clone(), flat.clone()
        self.peer_weights[bucket.name] = (weight, left, right)
        bucket.append_low_precision_decentralized_synchronous_op(
            weight, left, right, hierarchical=self.hierarchical, compression="MinMaxUInt8",
            group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        return do_nothing  # weights, not gradients, are communicated

    def init_post_backward_hook(self, bagua_ddp):
        return do_nothing

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if is_communication_step(bagua_ddp, self.communication_interval):
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
        check_flags(type(self).__name__, hierarchical=hierarchical)
        check_integer(type(self).__name__, "communication_interval", communication_interval, 1)
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
        # The ops' communication step (shift_one's partners follow it), kept
        # across re-bucketing and checkpoints: new ops continue the count.
        self._communication_step = 0

    def _current_step(self) -> int:
        return max((op.communication_step for op in self.ops.values()), default=self._communication_step)

    def init_tensors(self, bagua_ddp) -> List:
        self._communication_step = self._current_step()
        self.ops = {}
        return weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        op = bucket.append_decentralized_synchronous_op(
            _flat_weights(bucket), hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode, group=self.process_group)
        op.communication_step = self._communication_step
        self.ops[bucket.name] = op

    def state_dict(self, bagua_ddp) -> dict:
        return {"communication_step": self._current_step()}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        self._communication_step = int(state["communication_step"])
        for op in self.ops.values():
            op.communication_step = self._communication_step

    def ranks_share_weights(self) -> bool:
        return False

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            # Start the exchange now: it overlaps with forward and backward,
            # which only read the weights.
            if is_communication_step(bagua_ddp, self.communication_interval):
                bagua_ddp.mark_unready_tensors()

        return hook

    def init_backward_hook(self, bagua_ddp):
        return do_nothing

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            if is_communication_step(bagua_ddp, self.communication_interval):
                bagua_ddp.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    self.ops[bucket.name].copy_back_peer_weight(bucket)

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
        check_flags(type(self).__name__, hierarchical=hierarchical)
        check_choice(type(self).__name__, "peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)
        check_integer(type(self).__name__, "communication_interval", communication_interval, 1)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(process_group, self.hierarchical, self.peer_selection_mode,
                                          self.communication_interval)

