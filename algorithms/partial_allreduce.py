"""Ripples: partial all-reduce (P-Reduce) among small, changing groups of ranks.

Each communication step a rank averages its weights with the members of one
group instead of with every rank, so a slow rank holds up only the groups it
is in. Who averages with whom comes from a group generator
(design/ripples.md):

- ``"static"``: a conflict-free schedule every rank computes alone
  (:func:`static_schedule`): no messages, but a slow rank drags its groups;
- ``"random"``: Ripples' basic generator, a random group of ``group_size``
  around the requester, granted once its members are free;
- ``"smart"``: group buffers and global division of the idle ranks, with the
  slowdown filter (``slowdown_threshold``) that keeps ranks that fell behind
  out of the fast ranks' groups, and inter-intra phases on several nodes.

The random and smart generators run as a service on rank 0 (a C++ thread,
``GroupGenerator``); the P-Reduce is point-to-point traffic among the members
(``bagua.torch_api.partial_allreduce``): no communicator per group.

``abort(model)`` may be called by each rank at its own step count: the rank
stops training with the others but still executes the groups already
assigned to it (static: the scheduled steps up to the last rank's final
step), so nobody waits for it in vain. ``resume(model)`` is collective.
"""

import logging
import threading
import time
from typing import List, NamedTuple, Optional

import torch

from bagua.torch_api import InvalidArgumentError, get_local_size
from bagua.torch_api._core import core, tensor_view
from bagua.torch_api.algorithms._ripples_engine import Group, GroupGeneratorEngine, static_schedule
from bagua.torch_api.algorithms._ripples_service import GroupGenerator, _StaticProgress, group_stats
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks, do_nothing, weight_tensors

__all__ = ["PartialAllReduceAlgorithm", "PartialAllReduceAlgorithmImpl", "GroupGenerator",
           "GroupGeneratorEngine", "Group", "HistoryEntry", "static_schedule"]

GENERATORS = ("static", "random", "smart")
_log = logging.getLogger(__name__)


class HistoryEntry(NamedTuple):
    """One group this rank executed (``algorithm.history(model)``).

    ``step``: the rank's training step when the group ran; a group drained
    after ``abort`` (the rank no longer trains) carries the rank's last step.
    ``group_id``: the group's place in the global order (static: the
    scheduled step); strictly increasing along a rank's history.
    ``t_start``, ``t_end``: ``time.monotonic()`` seconds of the P-Reduce."""

    step: int
    group_id: int
    ranks: List[int]
    t_start: float
    t_end: float


class PartialAllReduceAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, group_size: int = 3, group_generator: str = "smart",
                 slowdown_threshold: Optional[int] = None, inter_intra: Optional[bool] = None,
                 communication_interval: int = 1, overlap: bool = True, warmup_steps: int = 0,
                 seed: int = 0, low_precision: bool = False):
        super().__init__(process_group)
        world = process_group.get_size()
        if group_size > world:
            raise InvalidArgumentError(
                f"PartialAllReduceAlgorithm: group_size {group_size} exceeds the world size {world}")
        if slowdown_threshold is not None and group_size >= world:
            _log.warning("PartialAllReduceAlgorithm: group_size %d >= world size %d: every group is global "
                         "and the slowdown filter cannot act", group_size, world)
        self.group_size = group_size
        self.mode = group_generator
        self.slowdown_threshold = slowdown_threshold
        self.inter_intra = inter_intra
        self.communication_interval = communication_interval
        self.overlap = overlap
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.low_precision = low_precision
        self.local_size = min(get_local_size() or world, world)
        self.partial = warmup_steps == 0
        self.steps_done = 0
        self._comm = None        # the P-Reduces' communicator
        self._generator = None   # random / smart
        self._progress = None    # static
        self._aborted = False
        self._inflight = None    # overlap: (thread, buffers, result)
        self._failed = None      # the error of a failed P-Reduce: no draining after it
        self._history: List[HistoryEntry] = []
        self._drained = 0              # groups executed after abort
        self._final_groups = 0         # of them, the final period's (see _final_period)
        self._schedule_ms: List[float] = []  # static: computing each group
        self._generator_stats = None   # the last generator's stats(), once it is dropped
        self._waited_s = 0.0
        # communication_stats(): P-Reduces with company, their seconds, and
        # the bytes of communicators already dropped (abort, then resume).
        self._reduces = 0
        self._reduce_s = 0.0
        self._bytes_of_closed_comms = 0

    # -- phases and tensors ------------------------------------------------
    def need_reset(self) -> bool:
        if not self.partial and self.steps_done >= self.warmup_steps:
            self.partial = True
            return True
        return False

    def ranks_share_weights(self) -> bool:
        return False

    def init_tensors(self, bagua_ddp) -> List:
        if not self.partial:
            return super().init_tensors(bagua_ddp)
        self._start(bagua_ddp)
        return weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        if not self.partial:
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True,
                                                     group=self.process_group)

    def _start(self, bagua_ddp) -> None:
        """Collective: the communicator and the generator of the P-Reduce phase."""
        if self._comm is not None:
            return
        self._comm = self.process_group.new_dedicated_communicator()
        self._aborted = False
        if self.mode == "static":
            self._progress = _StaticProgress(self.process_group.new_dedicated_communicator())
        else:
            self._generator = GroupGenerator(
                self.group_size, self.mode, self.slowdown_threshold, self.inter_intra, self.seed,
                process_group=self.process_group, local_size=self.local_size)

    # -- the step -----------------------------------------------------------
    def _is_communication_step(self, step: int) -> bool:
        return (step - 1) % self.communication_interval == 0

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            if not self.partial or self._aborted or not self.overlap:
                return
            step = bagua_ddp.step_counter
            if self._is_communication_step(step):
                self._begin_reduce(bagua_ddp, step)

        return hook

    def init_backward_hook(self, bagua_ddp):
        return do_nothing if self.partial else super().init_backward_hook(bagua_ddp)

    def init_post_backward_hook(self, bagua_ddp):
        if not self.partial:
            return super().init_post_backward_hook(bagua_ddp)

        def hook():
            # overlap: the average of the weights the gradient was taken at;
            # the optimizer then applies that gradient to it (D-PSGD order).
            self._finish_reduce(bagua_ddp)

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            self.steps_done = bagua_ddp.step_counter
            if not self.partial or self._aborted or self.overlap:
                return
            if optimizer is not bagua_ddp.optimizers[-1]:
                return
            step = bagua_ddp.step_counter
            if self._is_communication_step(step):
                self._begin_reduce(bagua_ddp, step)
                self._finish_reduce(bagua_ddp)

        return hook

    def _begin_reduce(self, bagua_ddp, step: int) -> None:
        """Snapshots the weights and P-Reduces the snapshot on a thread (the
        group's request included): training reads the weights meanwhile."""
        params = [p for _, p in bagua_ddp.bagua_build_params()]
        buffers = _flatten_by_dtype(params)
        written = _written_event(buffers)
        result = {}

        def run():
            try:
                if written is not None:
                    written.synchronize()
                result["group"] = self._reduce(buffers, step)
            except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
                result["error"] = error

        thread = threading.Thread(target=run, name="bagua-partial-allreduce", daemon=True)
        thread.start()
        self._inflight = (thread, params, buffers, result)

    def _finish_reduce(self, bagua_ddp) -> None:
        if self._inflight is None:
            return
        thread, params, buffers, result = self._inflight
        self._inflight = None
        started = time.monotonic()
        thread.join()
        self._waited_s += time.monotonic() - started
        if "error" in result:
            self._failed = result["error"]
            raise result["error"]
        with torch.no_grad():
            _unflatten_into(buffers, params)

    def _reduce(self, buffers, step: int):
        """One group's P-Reduce of ``buffers`` (this rank's weights), logged."""
        if self._generator is not None:
            group = self._generator.acquire_group()
            if group is None:
                return None
        else:
            self._progress.trained = step
            group = self._scheduled_group(step)
        self._execute(group, buffers, step)
        if self._generator is not None:
            self._generator.complete(group)
        return group

    def _scheduled_group(self, step: int) -> Group:
        """Static: this rank's group at ``step`` (its id is the step)."""
        start = time.perf_counter()
        ranks = static_schedule(self._comm.rank, (step - 1) // self.communication_interval, self._comm.size,
                                self.local_size)
        self._schedule_ms.append((time.perf_counter() - start) * 1e3)
        if len(self._schedule_ms) > 100000:
            del self._schedule_ms[0]
        return Group(step, ranks)

    def _execute(self, group: Group, buffers, step: int, drained: bool = False) -> None:
        """P-Reduces ``buffers`` in ``group`` and logs it; ``drained``: after
        abort, at the rank's last ``step``."""
        start = time.monotonic()
        if len(group.ranks) > 1:
            for buffer in buffers:
                if self.low_precision and buffer.dtype == torch.float32:
                    # The MinMaxUInt8 P-Reduce reads host memory: a CUDA
                    # buffer goes through a host copy.
                    host = buffer.cpu() if buffer.is_cuda else buffer
                    core.low_precision_partial_allreduce(self._comm, tensor_view(host), group.ranks, group.id)
                    if host is not buffer:
                        buffer.copy_(host)
                else:
                    # CUDA buffers: NCCL's ring on the device, or Gloo's
                    # through host staging (the communicator waits for them).
                    view = tensor_view(buffer, allow_cuda=True)
                    self._comm.partial_allreduce(view, view, group.ranks, "avg", group.id, False)
        end = time.monotonic()
        if len(group.ranks) > 1:
            self._reduces += 1
            self._reduce_s += end - start
        self._drained += int(drained)
        self._history.append(HistoryEntry(step, group.id, list(group.ranks), start, end))
        if len(self._history) > 100000:
            del self._history[0]

    # -- control --------------------------------------------------------------
    def abort(self, bagua_ddp, linger: bool = True) -> None:
        """Stops this rank's P-Reduces after draining the groups it still owes
        (and, with ``linger``, the groups the others choose it for)."""
        if self._aborted or self._comm is None:
            self._aborted = True
            return
        if self._failed is not None:
            # A peer or the generator failed: the groups this rank still owes
            # cannot complete. Dropping the generator aborts its channel, so
            # the others fail within their timeout instead of waiting for us.
            self._aborted = True
            self._inflight = None
            if self._progress is not None:
                self._progress.stop(core.env().comm_timeout_s + 1.0)
            self._drop_communicator()
            self._progress = None
            return
        self._finish_reduce(bagua_ddp)
        self._aborted = True
        params = [p for _, p in bagua_ddp.bagua_build_params()]
        buffers = _flatten_by_dtype(params)
        written = _written_event(buffers)
        if written is not None:
            written.synchronize()
        last_step = bagua_ddp.step_counter
        if self._generator is not None:
            if linger:
                self._final_group(buffers, last_step)
            self._generator.close(drain=lambda group: self._execute(group, buffers, last_step, drained=True),
                                  linger=linger)
            final_round_id = self._generator.final_round_id()
            if self.overlap and final_round_id is not None:
                # Every rank lingered to the end and is here: the same
                # final period as static's, under ids above every group's.
                self._final_period(buffers, last_step, [(phase, final_round_id + phase) for phase in range(4)])
        else:
            self._drain_static(bagua_ddp, buffers, linger)
        with torch.no_grad():
            _unflatten_into(buffers, params)
        self._drop_communicator()
        self._progress = None

    def _final_group(self, buffers, last_step: int) -> None:
        """One more group for the weights as they end (with overlap the last
        update was applied after the last P-Reduce): the ranks that already
        stopped linger, so the one that stops last averages with them."""
        group = self._generator.acquire_group()
        if group is not None:
            self._execute(group, buffers, last_step, drained=True)
            self._generator.complete(group)

    def _drop_communicator(self) -> None:
        """Drops the communicator and the generator (their counts kept):
        a dropped generator aborts its channel."""
        self._bytes_of_closed_comms += self._comm.bytes_sent
        self._comm = None
        if self._generator is not None:
            self._generator_stats = self._generator.stats()
            self._generator = None

    def _drain_static(self, bagua_ddp, buffers, linger: bool) -> None:
        progress = self._progress
        progress.stopped = True
        timeout_s = core.env().comm_timeout_s
        last_step = bagua_ddp.step_counter
        step = last_step + 1
        while progress.next_drain_step(step, timeout_s):
            if self._is_communication_step(step):
                self._execute(self._scheduled_group(step), buffers, last_step, drained=True)
            step += 1
        progress.join()
        if self.overlap and linger:
            self._final_static_period(buffers, step, last_step)

    def _final_static_period(self, buffers, step: int, last_step: int) -> None:
        """The final weights through one more period of the schedule, on the
        next communication steps (see _final_period). Every rank leaves the
        drain at the same step (one past the last any rank trained): they
        all compute the same groups."""
        steps = []
        while len(steps) < 4:
            if self._is_communication_step(step):
                steps.append(((step - 1) // self.communication_interval, step))
            step += 1
        self._final_period(buffers, last_step, steps)

    def _final_period(self, buffers, last_step: int, phases) -> None:
        """P-Reduces the final weights in this rank's static-schedule group
        at each (schedule step, group id) of ``phases``, one period. With
        overlap each rank applied its last update after its last P-Reduce:
        without this, each rank's model ends one local update (its own
        momentum) away from the others', up to 5 accuracy points below
        them on digits (static; smart left a node 2-4 points below), and
        one more group (a pair, at some phases) only halved that. One
        period's groups connect every rank, so each rank's last update
        reaches all."""
        for schedule_step, group_id in phases:
            ranks = static_schedule(self._comm.rank, schedule_step, self._comm.size, self.local_size)
            self._execute(Group(group_id, ranks), buffers, last_step, drained=True)
            self._final_groups += 1

    def resume(self, bagua_ddp) -> None:
        """Collective: starts P-Reducing again."""
        self._start(bagua_ddp)

    def shutdown(self, bagua_ddp) -> None:
        try:
            self.abort(bagua_ddp, linger=False)  # exiting: nothing gains from lingering
        except Exception as error:  # noqa: BLE001 - a peer gone: nothing left to drain with
            _log.warning("PartialAllReduceAlgorithm: draining at shutdown: %s", error)

    def history(self) -> List[HistoryEntry]:
        return list(self._history)

    def communication_stats(self) -> List[dict]:
        bytes_sent = self._bytes_of_closed_comms + (self._comm.bytes_sent if self._comm is not None else 0)
        name = "low_precision_partial_allreduce" if self.low_precision else "partial_allreduce"
        return [{"name": name, "executions": self._reduces, "bytes_sent": bytes_sent,
                 "total_seconds": self._reduce_s}]

    def stats(self) -> dict:
        sizes = [len(h.ranks) for h in self._history]
        if self._generator is not None:
            stats = self._generator.stats()
        elif self._generator_stats is not None:  # after abort
            stats = dict(self._generator_stats)
        else:  # static: every group is computed here, no buffer
            stats = group_stats(sizes, self._schedule_ms, 0)
        stats.update({"executed": len(self._history), "executed_solo": sum(1 for s in sizes if s == 1),
                      "executed_mean_group_size": sum(sizes) / len(sizes) if sizes else 0.0,
                      "drained": self._drained, "final_period": self._final_groups,
                      "waited_s": self._waited_s,
                      "reduce_s": sum(h.t_end - h.t_start for h in self._history)})
        return stats


def _flatten_by_dtype(params) -> List[torch.Tensor]:
    """One flat copy of the weights per dtype, in parameter order."""
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p.detach().reshape(-1))
    return [torch.cat(chunks) for chunks in by_dtype.values()]


def _written_event(buffers):
    """For CUDA buffers, an event after their copies on torch's current
    stream: the P-Reduce's communicator (its own stream, or host staging)
    does not wait for torch's stream, so the P-Reduce waits for this first.
    None for host buffers."""
    if not buffers or not buffers[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(buffers[0].device))
    return event


def _unflatten_into(buffers, params) -> None:
    offsets = {}
    index = {}
    for p in params:
        if p.dtype not in index:
            index[p.dtype] = len(index)
            offsets[p.dtype] = 0
        buffer = buffers[index[p.dtype]]
        n = p.numel()
        p.data.copy_(buffer[offsets[p.dtype]:offsets[p.dtype] + n].view_as(p))
        offsets[p.dtype] += n


class PartialAllReduceAlgorithm(Algorithm):
    impl_class = PartialAllReduceAlgorithmImpl

    def __init__(self, group_size: int = 3, group_generator: str = "smart",
                 slowdown_threshold: Optional[int] = None, inter_intra: Optional[bool] = None,
                 communication_interval: int = 1, overlap: bool = True, warmup_steps: int = 0,
                 seed: int = 0, low_precision: bool = False):
        """
        Args:
            group_size: the largest group (an int >= 2); the static schedule ignores it.
            group_generator: "static", "random" (Ripples' basic generator) or "smart".
            slowdown_threshold: smart only: a rank that made this many fewer requests
                than the one dividing is left out of its groups (None: no filter).
            inter_intra: smart only: alternate groups across nodes (one head per node)
                and within nodes; None: on when LOCAL_WORLD_SIZE < world size.
            communication_interval: P-Reduce every k-th step.
            overlap: P-Reduce during forward and backward and adopt the average before the
                optimizer step (False: after the optimizer step, blocking).
            warmup_steps: GradientAllReduce steps first.
            seed: the generator's random seed.
            low_precision: P-Reduce float32 weights with 8-bit MinMaxUInt8 on the wire
                (about a quarter of the bytes; the members still end bit-identical).
        """
        name = type(self).__name__
        check = ArgumentChecks(name)
        check.integer("group_size", group_size, 2)
        check.choice("group_generator", group_generator, GENERATORS)
        if slowdown_threshold is not None:
            check.integer("slowdown_threshold", slowdown_threshold, 1)
            if group_generator != "smart":
                raise InvalidArgumentError(
                    f"{name}: slowdown_threshold needs group_generator 'smart', got {group_generator!r}")
        if inter_intra is not None:
            check.flags(inter_intra=inter_intra)
            if inter_intra and group_generator != "smart":
                raise InvalidArgumentError(
                    f"{name}: inter_intra needs group_generator 'smart', got {group_generator!r}")
        check.integer("communication_interval", communication_interval, 1)
        check.flags(overlap=overlap)
        check.integer("warmup_steps", warmup_steps, 0)
        check.integer("seed", seed, 0)
        check.flags(low_precision=low_precision)
        self.keep_settings(group_size=group_size, group_generator=group_generator,
                           slowdown_threshold=slowdown_threshold, inter_intra=inter_intra,
                           communication_interval=communication_interval, overlap=overlap,
                           warmup_steps=warmup_steps, seed=seed, low_precision=low_precision)

    @staticmethod
    def _impl(bagua_module) -> PartialAllReduceAlgorithmImpl:
        return bagua_module.bagua_ddp.bagua_algorithm_impl

    def abort(self, bagua_module, linger: bool = True) -> None:
        """This rank stops P-Reducing, after executing the groups it still owes
        (any rank, any step count); training may go on locally.

        With ``linger`` (random and smart; static always does so), the rank
        first P-Reduces its final weights in one more group, then stays
        available to the ranks still training, which keep choosing it for
        their groups, and returns once every rank has aborted: so the rank
        that finishes last does not train its last steps alone, and each
        rank ends near the others' average. A lingering rank that nobody
        chooses for half of BAGUA_COMM_TIMEOUT_S (the others stopped
        requesting groups) returns then. ``linger=False`` leaves at once."""
        ArgumentChecks("PartialAllReduceAlgorithm.abort").flags(linger=linger)
        self._impl(bagua_module).abort(bagua_module.bagua_ddp, linger)

    def resume(self, bagua_module) -> None:
        """Collective: P-Reduce again."""
        self._impl(bagua_module).resume(bagua_module.bagua_ddp)

    def history(self, bagua_module) -> List[HistoryEntry]:
        """The groups this rank executed, oldest first (the last 100000):
        :class:`HistoryEntry` ``(step, group_id, ranks, t_start, t_end)``,
        group ids strictly increasing; the groups drained after ``abort``
        carry the rank's last step (``stats()["drained"]`` counts them)."""
        return self._impl(bagua_module).history()

    def stats(self, bagua_module) -> dict:
        """On every rank and for every generator: ``requests``, ``solo``,
        ``mean_group_size``, ``request_latency_ms`` (``p50``, ``p99``) and
        ``max_buffer_len`` (static: 0, it has no buffer), as
        ``GroupGenerator.stats()`` (the host adds ``engine``); then this
        rank's ``executed``, ``executed_solo``, ``executed_mean_group_size``,
        ``drained`` (after abort), ``waited_s`` (blocked on the P-Reduce
        after backward) and ``reduce_s`` (inside P-Reduces)."""
        return self._impl(bagua_module).stats()
