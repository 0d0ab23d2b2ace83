"""A check users can turn on: are the replicas still equal?

Algorithms that average gradients promise every rank the same weights after
each step. A mix-up that breaks the promise (a rank's weights changed behind
the engine's back, a collective paired with the wrong peer's data) shows
only when someone compares ranks. With ``with_bagua(...,
check_replicas_every=N)`` or ``BAGUA_CHECK_REPLICAS=N``, every N steps the
engine fingerprints each parameter (the sum of its bits read as integers:
any change to any element changes it, up to wrap-around, with no rounding),
allgathers the fingerprints (one int64 per parameter) and raises
:class:`ReplicasDivergedError` on every rank, naming the first parameter
that differs, the ranks that hold another value and the step.

It cannot see ranks that agree on a wrong model: only a comparison with a
reference (the tests against DDP) can.
"""

from typing import List, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, core, log
from bagua.torch_api.communication import allgather

__all__ = ["ReplicasDivergedError", "ReplicaCheck", "resolve_every"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDivergedError(RuntimeError):
    """The ranks' weights differ where the algorithm promises them equal."""


def resolve_every(every: Optional[int]) -> int:
    """``with_bagua``'s ``check_replicas_every`` (None: BAGUA_CHECK_REPLICAS;
    0: off) as a number of steps, 0 for never."""
    if every is None:
        return int(core.env().check_replicas_every)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise InvalidArgumentError(f"with_bagua: check_replicas_every must be an int >= 0 (0: off), got {every!r}")
    return every


def fingerprint(tensor: torch.Tensor) -> int:
    """The sum of ``tensor``'s elements read as integers of their width."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    bits = flat.contiguous().view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
    return int(bits.to(torch.int64).sum())


class ReplicaCheck:
    """Compares one engine's parameters across its ranks every ``every`` steps."""

    def __init__(self, engine, every: int):
        self.engine = engine
        self.every = every
        if every and not engine.bagua_algorithm_impl.ranks_share_weights():
            log("info", f"{engine.bagua_module_name}: check_replicas_every={every} has no effect: "
                        f"{type(engine.bagua_algorithm_impl).__name__}'s ranks hold weights of their own")
            self.every = 0

    def after_step(self, step: int) -> None:
        """Called at the start of step ``step + 1``, when the weights are
        those of ``step`` steps (collective when due)."""
        if not self.every or step == 0 or step % self.every != 0:
            return
        if not self.engine.bagua_algorithm_impl.ranks_share_weights():
            return  # e.g. auto chose otherwise since
        named = self.engine.bagua_build_params() + self.engine.sparse_parameters
        group = self.engine.engine_group
        mine = torch.tensor([fingerprint(p) for _, p in named], dtype=torch.int64)
        size = group.get_size()
        if size == 1 or not named:
            return
        gathered = torch.zeros(size * len(named), dtype=torch.int64)
        allgather(mine, gathered, comm=group)
        table: List[List[int]] = gathered.view(size, len(named)).t().tolist()
        for (name, _), per_rank in zip(named, table):
            others = [r for r, value in enumerate(per_rank) if value != per_rank[0]]
            if others:
                raise ReplicasDivergedError(
                    f"rank {group.get_rank()} ({self.engine.bagua_module_name}): after step {step} the replicas "
                    f"differ: parameter '{name}' on rank(s) {others} is not rank 0's, although "
                    f"{type(self.engine.bagua_algorithm_impl).__name__} keeps every rank's weights equal "
                    "(a change made on some ranks only, or a communication mix-up)")
