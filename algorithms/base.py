"""The algorithm interface: how an algorithm tells the runtime what to
communicate, how, and when.

An :class:`Algorithm` holds the user's arguments (validated when constructed);
``reify(process_group)`` makes the :class:`AlgorithmImpl` that the runtime
calls. Each hook has a default that suits gradient-based algorithms, so an
algorithm overrides only what differs. See docs/writing_an_algorithm.md.
"""

from typing import Callable, List

import torch

from bagua.torch_api._core import InvalidArgumentError

from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["Algorithm", "AlgorithmImpl"]


def check_flags(algorithm: str, **flags) -> None:
    """Raises InvalidArgumentError unless every flag is True or False."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{algorithm}: {name} must be True or False, got {value!r}")


class Algorithm:
    """User-facing algorithm: arguments only. Subclasses implement ``reify``."""

    def reify(self, process_group) -> "AlgorithmImpl":
        raise NotImplementedError(f"{type(self).__name__} must implement reify(process_group)")

    @classmethod
    def init(cls, *args, **kwargs) -> "Algorithm":
        """Bagua's spelling of the constructor, kept for old scripts."""
        return cls(*args, **kwargs)


class AlgorithmImpl:
    """The runtime-facing side of an algorithm, bound to a process group."""

    def __init__(self, process_group):
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Checked before each forward: True rebuilds tensors, buckets and ops
        (for algorithms that change phase, e.g. after warmup)."""
        return False

    def init_tensors(self, bagua_ddp) -> List[BaguaTensor]:
        """The tensors to communicate, in the order gradients usually become
        ready (reverse parameter order). Default: every parameter's gradient."""
        tensors = []
        for name, param in reversed(bagua_ddp.bagua_build_params()):
            param.bagua_ensure_grad()
            tensors.append(param.ensure_bagua_tensor(
                name, bagua_ddp.bagua_module_name,
                getter_closure=lambda p: p.grad,
                setter_closure=lambda p, t: setattr(p, "grad", t)))
        return tensors

    def tensors_to_buckets(self, tensors: List[List[BaguaTensor]], do_flatten: bool) -> List[BaguaBucket]:
        """Turns the planner's grouping into buckets."""
        return [BaguaBucket(group, flatten=do_flatten, name=f"bucket{index}")
                for index, group in enumerate(tensors)]

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        """Appends this algorithm's ops to ``bucket``."""
        bucket.clear_ops()

    def init_forward_pre_hook(self, bagua_ddp) -> Callable:
        def hook(inputs):
            pass

        return hook

    def init_backward_hook(self, bagua_ddp) -> Callable:
        """Called as each parameter's gradient is accumulated. Default: mark the
        gradient ready, which lets its bucket communicate during backward."""

        def hook(parameter_name: str, parameter: torch.nn.Parameter):
            tensor = bagua_ddp._tensors_by_name.get(parameter_name)
            if tensor is not None:
                tensor.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp) -> Callable:
        """Called once backward has finished. Default: communicate what was not
        marked (unused parameters) and wait for all buckets."""

        def hook():
            bagua_ddp.mark_unready_tensors()
            bagua_ddp.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp) -> Callable:
        def hook(optimizer: torch.optim.Optimizer):
            pass

        return hook
