"""Ripples' group generation over the network, for the P-Reduce algorithm
(``partial_allreduce.py``, which re-exports the public names).

- :class:`GroupGenerator`: the random and smart generators as a service, a
  C++ thread on one rank answering every rank (``GroupGeneratorService``);
- :class:`_StaticProgress`: for the static schedule, which needs no
  generator, the background exchange that tells a rank that stopped
  training which scheduled steps it still owes the others.
"""

import contextlib
import threading
import time
from typing import Callable, List, Optional

import torch

from bagua.torch_api import InvalidArgumentError, get_local_size
from bagua.torch_api._core import core
from bagua.torch_api.algorithms._ripples_engine import Group
from bagua.torch_api.algorithms.base import ArgumentChecks

__all__ = ["GroupGenerator"]

class GroupGenerator:
    """The group generator service (collective to construct): rank
    ``host_rank`` runs the engine on a C++ thread and answers every rank.

    ``with gen.acquire() as group:`` blocks until this rank's next group can
    run; leaving the block completes it. ``close(drain)`` leaves: ``drain``
    runs every group still assigned to this rank, then the rank closes (the
    host returns once every rank closed). ``close(drain, linger=True)``
    first lingers: ``drain`` also runs the groups the still-training ranks
    choose this rank for, until every rank lingers or left.
    """

    def __init__(self, group_size: int = 3, mode: str = "smart", slowdown_threshold: Optional[int] = None,
                 inter_intra: Optional[bool] = None, seed: int = 0, process_group=None,
                 local_size: Optional[int] = None, host_rank: int = 0):
        from bagua.torch_api.communication import _get_default_group
        group = process_group or _get_default_group()
        world = group.get_size()
        check = ArgumentChecks("GroupGenerator")
        check.integer("group_size", group_size, 2)
        check.choice("mode", mode, ("random", "smart"))
        if slowdown_threshold is not None:
            check.integer("slowdown_threshold", slowdown_threshold, 1)
        local_size = local_size or get_local_size() or world
        if inter_intra is None:
            inter_intra = mode == "smart" and local_size < world
        check.flags(inter_intra=inter_intra)
        if mode != "smart" and (inter_intra or slowdown_threshold is not None):
            raise InvalidArgumentError(
                f"GroupGenerator: inter_intra and slowdown_threshold need mode 'smart', got mode {mode!r}")
        self.world_size = world
        self._service = core.GroupGeneratorService(
            group.get_global_communicator(), group_size=group_size, mode=mode,
            slowdown_threshold=slowdown_threshold, local_size=min(local_size, world),
            inter_intra=inter_intra, seed=seed, host_rank=host_rank)
        self._closed = False

    def acquire_group(self) -> Optional[Group]:
        """This rank's next group (blocking), or None once it left and
        drained. Call :meth:`complete` after executing it."""
        return self._service.acquire()

    def complete(self, group: Group) -> None:
        self._service.complete(group.id)

    @contextlib.contextmanager
    def acquire(self):
        group = self.acquire_group()
        if group is None:
            raise InvalidArgumentError("GroupGenerator.acquire: this rank has left (close was called)")
        yield group
        self.complete(group)

    def close(self, drain: Optional[Callable[[Group], None]] = None, linger: bool = False) -> None:
        if self._closed:
            return
        if linger:
            self._service.linger()
        else:
            self._service.leave()
        while True:
            group = self.acquire_group()
            if group is None:
                break
            if drain is not None:
                drain(group)
            self.complete(group)
        self._service.close()
        self._closed = True

    def final_round_id(self) -> Optional[int]:
        """After ``close(linger=True)``: when every rank lingered to the end
        (none left first), the first group id after every group the
        generator created, the same on every rank; else None."""
        return self._service.final_round_id()

    def history(self) -> list:
        """[(id, ranks, t_start, t_end)] of the groups this rank executed
        (time.monotonic() seconds), oldest first."""
        return [(i, list(r), s, e) for i, r, s, e in self._service.history()]

    def stats(self) -> dict:
        """On every rank: ``requests``, ``solo``, ``mean_group_size`` (of the
        groups this rank received), ``request_latency_ms`` (``p50``, ``p99``
        of its ``acquire`` calls) and ``max_buffer_len`` (the longest group
        buffer any rank had, as of this rank's last group); on the host also
        ``engine``, the engine's own statistics."""
        history = self._service.history()
        stats = group_stats([len(r) for _, r, _, _ in history], self._service.acquire_latencies_ms(),
                            self._service.max_buffer_len())
        if self._service.rank == self._service.host_rank:
            stats["engine"] = dict(self._service.engine_stats())
        return stats


def group_stats(sizes: List[int], latencies_ms: List[float], max_buffer_len: int) -> dict:
    """The statistics every rank reports about the groups it received."""
    latencies = sorted(latencies_ms)

    def quantile(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return {"requests": len(sizes), "solo": sum(1 for s in sizes if s == 1),
            "mean_group_size": sum(sizes) / len(sizes) if sizes else 0.0,
            "request_latency_ms": {"p50": quantile(0.5), "p99": quantile(0.99)},
            "max_buffer_len": max_buffer_len}


class _StaticProgress:
    """For the static schedule: when may a rank that stopped training stop
    P-Reducing? A background allreduce (every ``interval_s``) of the largest
    step any rank trained and of the number of ranks that stopped. A stopped
    rank executes its scheduled groups for every step some rank reached, and
    stops once all ranks stopped past the last of them: then every step up to
    the last rank's final step ran on every rank, and no group misses a
    member."""

    def __init__(self, communicator, interval_s: float = 0.005):
        self._comm = communicator
        self._interval_s = interval_s
        self.trained = 0  # this rank's step, set before its P-Reduce
        self.stopped = False
        self.max_trained = 0
        self.all_stopped = False
        self._error = None
        self._stop = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="bagua-static-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        mine = torch.zeros(2, dtype=torch.int64)
        view = core.TensorView(mine.data_ptr(), 2, "int64", "cpu")
        count = torch.zeros(1, dtype=torch.int64)
        count_view = core.TensorView(count.data_ptr(), 1, "int64", "cpu")
        try:
            while not self._stop:
                mine[0] = self.trained
                count[0] = int(self.stopped)
                self._comm.allreduce(view, view, "max")
                self._comm.allreduce(count_view, count_view, "sum")
                with self._changed:
                    self.max_trained = int(mine[0])
                    self.all_stopped = int(count[0]) == self._comm.size
                    self._changed.notify_all()
                if self.all_stopped:
                    return
                time.sleep(self._interval_s)
        except Exception as error:  # noqa: BLE001 - surfaced to the training thread
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def next_drain_step(self, step: int, timeout_s: float) -> bool:
        """For a stopped rank about to consider ``step``: True to execute it,
        False when every rank stopped before it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if self._error is not None:
                    raise self._error
                if step <= self.max_trained:
                    return True
                if self.all_stopped:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"PartialAllReduce static drain: no progress of the other ranks "
                                       f"within {timeout_s} s at step {step}")
                self._changed.wait(left)

    def join(self) -> None:
        self._thread.join()

    def stop(self, timeout_s: float) -> None:
        """After a failure: end the rounds. A round in flight ends within the
        communicator's timeout (its peers stop too); joining it keeps the
        thread from running into the interpreter's exit."""
        self._stop = True
        self._thread.join(timeout_s)
