"""Ripples' network-free parts: the static schedule and the group generator engine.

Both run in C++ (``include/bagua/ops/static_schedule.h``,
``include/bagua/runtime/group_generator.h``); this module checks arguments
(``ValueError`` naming the argument and the value) and documents them.
``bagua.torch_api.algorithms.partial_allreduce`` re-exports both names; the
rules are in ``docs/ripples.md``.
"""

import numbers
from typing import Dict, List, Optional, Union

from bagua.torch_api._core import core

__all__ = ["static_schedule", "paper_static_schedule", "Group", "GroupGeneratorEngine"]

Group = core.Group
Group.__doc__ = """A group of ranks that P-Reduce together.

``id`` (int >= 1) is its place in the global serialisation order: every rank
receives its groups in increasing id. ``ranks`` is the sorted member list.
"""

_MODES = ("random", "smart")


def _int(name: str, value, minimum: Optional[int] = None) -> int:
    # bool is an int subclass: True is not a valid rank or size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _rank(engine_world_size: int, rank) -> int:
    rank = _int("rank", rank)
    if not 0 <= rank < engine_world_size:
        raise ValueError(f"rank must be in [0, world_size = {engine_world_size}), got {rank}")
    return rank


def static_schedule(rank: int, step: int, world_size: int, local_size: int) -> List[int]:
    """The group ``rank`` P-Reduces with at ``step`` under the static schedule.

    A pure function: every member computes the same group, so the groups of a
    step are disjoint and need no group generator. Returns the sorted member
    list, which contains ``rank``; ``[rank]`` alone means no sync at this step.
    Nodes are ``local_size`` consecutive ranks (the last may be smaller);
    phase = step mod 4. The groups of Ripples' table
    (:func:`paper_static_schedule`): phases 1 and 3 average each node; phase
    0 joins the local worker 0 of every node and pairs local workers 2-3,
    4-5, ...; phase 2 pairs local workers 0-3, 4-6, 5-7, ... and local worker
    1 with local worker 1 of the opposite node on a ring. The ranks the table
    leaves idle in phases 0 and 2 average with the idle ranks of the same
    local index on the other nodes, and with one rank per node, phases 1 and
    3 pair neighbouring ranks (docs/ripples.md, "Static schedule"). The
    schedule ignores any group size.
    """
    return core.static_schedule(*_schedule_args(rank, step, world_size, local_size))


def paper_static_schedule(rank: int, step: int, world_size: int, local_size: int) -> List[int]:
    """The group of the Ripples paper's static table, exactly (idle ranks
    alone); :func:`static_schedule` is what the algorithm runs."""
    return core.paper_static_schedule(*_schedule_args(rank, step, world_size, local_size))


def _schedule_args(rank, step, world_size, local_size):
    world_size = _int("world_size", world_size, 1)
    local_size = _int("local_size", local_size, 1)
    step = _int("step", step, 0)
    rank = _rank(world_size, rank)
    return rank, step, world_size, local_size


class GroupGeneratorEngine:
    """Ripples' group generator as a pure, deterministic state machine (no network).

    Modes:

    - ``"random"`` (the paper's basic generator): a request draws the caller
      and ``group_size - 1`` random other ranks; a group is granted when none
      of its members holds another group and no earlier pending group shares a
      member (no overtaking). A rank whose group is not granted gets ``None``
      and calls :meth:`poll` later.
    - ``"smart"``: a request returns the head of the caller's group buffer;
      when it is empty, all idle ranks (not left, buffer empty, not executing;
      with ``slowdown_threshold``, only those at most ``slowdown_threshold - 1``
      requests behind the caller) are partitioned into ``ceil(|F|/group_size)``
      random groups of sizes differing by at most one. With ``inter_intra``,
      one head per node is grouped across nodes and the others within their
      node, then every node is one group (two groups per rank per division).

    Bounded isolation (with ``slowdown_threshold``): a rank that the fastest
    rank's divisions leave out (``slowdown_threshold`` or more requests
    behind) and that would be alone in the group its own division gives it,
    for the ``company_every``-th time in a row, gets one companion: a busy
    rank (executing, or holding a group) with room in its buffer, of another
    node with ``inter_intra``. The companion runs that group at its next
    request, where the slow rank already waits. With ``inter_intra`` such a
    rank heads its node and takes no intra-phase group.

    Group ids increase by one in creation (smart) or grant (random) order and
    every rank receives its groups in increasing id. The same arguments and the
    same sequence of calls give the same groups.

    Args:
        world_size: number of ranks (int >= 1).
        group_size: the maximum group size (int >= 2).
        mode: ``"random"`` or ``"smart"``.
        slowdown_threshold: C_thres (int >= 1), smart only; ``None``: no filter.
        local_size: ranks per node (int >= 1), nodes being consecutive ranks;
            ``None``: one node.
        inter_intra: inter-intra divisions (bool), smart only.
        seed: the random seed (int >= 0).
        company_every: K (int >= 0): a rank behind is alone in at most
            ``K - 1`` groups in a row when a busy rank has room; ``0``: never
            given company (the paper's rule).
    """

    #: Returned by :meth:`request` and :meth:`poll` to a rank that has left and
    #: has no group left to execute.
    DONE = core.GroupGeneratorEngine.DONE

    def __init__(
        self,
        world_size: int,
        group_size: int = 3,
        mode: str = "smart",
        slowdown_threshold: Optional[int] = None,
        local_size: Optional[int] = None,
        inter_intra: bool = False,
        seed: int = 0,
        company_every: int = 1,
    ):
        world_size = _int("world_size", world_size, 1)
        group_size = _int("group_size", group_size, 2)
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if slowdown_threshold is not None:
            slowdown_threshold = _int("slowdown_threshold", slowdown_threshold, 1)
            if mode != "smart":
                raise ValueError(
                    f"slowdown_threshold = {slowdown_threshold} needs mode 'smart', "
                    f"got mode {mode!r}"
                )
        if local_size is not None:
            local_size = _int("local_size", local_size, 1)
        if not isinstance(inter_intra, bool):
            raise ValueError(f"inter_intra must be a bool, got {inter_intra!r}")
        if inter_intra and mode != "smart":
            raise ValueError(f"inter_intra = True needs mode 'smart', got mode {mode!r}")
        seed = _int("seed", seed, 0)
        if seed >= 2**64:
            raise ValueError(f"seed must be < 2**64, got {seed}")
        company_every = _int("company_every", company_every, 0)
        self._engine = core.GroupGeneratorEngine(
            world_size,
            group_size=group_size,
            mode=mode,
            slowdown_threshold=slowdown_threshold,
            local_size=local_size,
            inter_intra=inter_intra,
            seed=seed,
            company_every=company_every,
        )
        self._world_size = world_size

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_size(self) -> int:
        return self._engine.group_size

    @property
    def mode(self) -> str:
        return self._engine.mode

    def request(self, rank: int) -> Union[Group, None, object]:
        """``rank`` asks for its next group (counts one request).

        Returns its next :class:`Group` (execute it, then :meth:`complete`),
        ``None`` (random mode: not granted yet; :meth:`poll` later) or
        :attr:`DONE` (the rank has left and holds no group). Raises
        ``ValueError`` while the rank executes a group or has an outstanding
        request.
        """
        return self._engine.request(_rank(self._world_size, rank))

    def poll(self, rank: int) -> Union[Group, None, object]:
        """A rank whose request returned ``None``: its granted group, ``None``
        or :attr:`DONE`; not a new request."""
        return self._engine.poll(_rank(self._world_size, rank))

    def complete(self, rank: int, group_id: int) -> None:
        """``rank`` finished executing ``group_id``, the group it last received."""
        self._engine.complete(_rank(self._world_size, rank), _int("group_id", group_id, 0))

    def leave(self, rank: int) -> None:
        """``rank`` stops training: never chosen again; its requests return the
        groups it still holds, then :attr:`DONE`. Idempotent."""
        self._engine.leave(_rank(self._world_size, rank))

    def linger(self, rank: int) -> None:
        """``rank`` stops training but stays available: still chosen by the
        others' requests, while its own requests create nothing (they return
        its queued groups, else ``None`` until one arrives). Once every rank
        that has not left lingers, they all leave. Idempotent."""
        self._engine.linger(_rank(self._world_size, rank))

    def is_lingering(self, rank: int) -> bool:
        return self._engine.is_lingering(_rank(self._world_size, rank))

    def lock_vector(self) -> List[bool]:
        """Per rank: holds a group (queued or executing)."""
        return self._engine.lock_vector()

    def buffer(self, rank: int) -> List[Group]:
        """The groups queued for ``rank``, not yet handed out, in order."""
        return self._engine.buffer(_rank(self._world_size, rank))

    def counters(self) -> List[int]:
        """Requests per rank."""
        return self._engine.counters()

    def stats(self) -> Dict[str, Union[int, float]]:
        """``requests``, ``groups`` (created or granted), ``solo`` (groups of one),
        ``mean_group_size``, ``max_buffer_len``, ``divisions`` (smart),
        ``company`` (companions given to ranks behind)."""
        return self._engine.stats()

    def waiting(self) -> List[int]:
        """Ranks whose request returned ``None`` and that have not received a group yet."""
        return self._engine.waiting()

    def pending(self) -> List[Group]:
        """Random mode: drawn groups not yet granted (id 0), in order."""
        return self._engine.pending()

    def executing(self, rank: int) -> Optional[Group]:
        """The group ``rank`` received and has not completed, if any."""
        return self._engine.executing(_rank(self._world_size, rank))

    def has_left(self, rank: int) -> bool:
        return self._engine.has_left(_rank(self._world_size, rank))

    def outstanding_groups(self) -> int:
        """Groups handed to their members and not yet completed by all of them."""
        return self._engine.outstanding_groups()

    def drained(self) -> bool:
        """Nothing pending, queued or executing."""
        return self._engine.drained()

    def final_round_id(self) -> Optional[int]:
        """Once every rank lingered to the end (none left first): an id above
        every group's; else None."""
        return self._engine.final_round_id()

    def __repr__(self) -> str:
        return (
            f"GroupGeneratorEngine(world_size={self._world_size}, group_size={self.group_size}, "
            f"mode={self.mode!r})"
        )
