"""Asynchronous model average: every rank trains at its own pace while a
background thread averages the weights of all ranks every
``sync_interval_ms``. A slow rank no longer stalls the others.

For the first ``warmup_steps`` steps it is GradientAllReduce (synchronous),
then the weights are averaged asynchronously. ``abort(model)`` stops the
background averaging on every rank (agreed at the next round, so ranks that
ran different numbers of steps stop cleanly; training goes on locally) and
``resume(model)`` (called by every rank) starts it again;
``abort(model, average=True)`` also averages the weights once, synchronously,
so every rank ends with the same model.

Bounded staleness: with ``max_staleness_steps=K`` a rank that took K local
steps since the last completed averaging round waits for the next one before
its next step, so how far the replicas drift apart no longer depends on how
the machine schedules the ranks. ``None`` is Bagua's unbounded behaviour.
``stats(model)`` reports the steps per round, the round time and the
distance of this rank's weights to the round's average (also logged at info
and recorded on the timeline). See docs/algorithms.md.
"""

import contextlib
import logging
import math
from typing import List, Optional

import torch

from bagua.torch_api import BaguaError, ReduceOp, allreduce_inplace, timeline
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks, do_nothing, weight_tensors

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl", "DEFAULT_MAX_STALENESS_STEPS"]

# The documented default bound (docs/algorithms.md: how it was chosen).
DEFAULT_MAX_STALENESS_STEPS = 16


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0, max_staleness_steps: Optional[int] = DEFAULT_MAX_STALENESS_STEPS):
        super().__init__(process_group)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self.max_staleness_steps = max_staleness_steps
        self.asynchronous = warmup_steps == 0
        self.ops = []
        self.steps_done = 0
        self._started = False
        self._locked = False
        self._stepped = set()  # ids of the optimizers that stepped since the lock was taken

    def need_reset(self) -> bool:
        # Checked before each forward, after `steps_done` forwards.
        if not self.asynchronous and self.steps_done >= self.warmup_steps:
            self.asynchronous = True
            return True
        return False

    def state_dict(self, bagua_ddp) -> dict:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        # need_reset switches to the asynchronous phase again if the loaded
        # step count is past the warmup (the engine rebuilds its buckets).
        self.steps_done = int(state["steps_done"])
        self.asynchronous = self.warmup_steps == 0

    def ranks_share_weights(self) -> bool:
        return False

    @contextlib.contextmanager
    def hold_weights(self, bagua_ddp):
        # Between steps the background thread applies its averages whenever
        # the lock is free: a checkpoint could save half-updated weights.
        taken = self.asynchronous and self._started and not self._locked
        if taken:
            self.lock(bagua_ddp)
        try:
            yield
        finally:
            if taken:
                self.unlock(bagua_ddp)

    def init_tensors(self, bagua_ddp) -> List:
        # Re-bucketing: the running ops stop on every rank (all ranks re-bucket
        # at the same step, and abort agrees at the next round); new ones start.
        self.abort(bagua_ddp)
        self.ops = []
        self._started = False
        if self.asynchronous:
            return weight_tensors(bagua_ddp)
        return super().init_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        if self.asynchronous:
            op = bucket.append_asynchronous_model_average_op(
                peer_selection_mode=self.peer_selection_mode, group=self.process_group,
                sync_interval_ms=self.sync_interval_ms, max_staleness_steps=self.max_staleness_steps)
            op.set_timeline(timeline.get(self.process_group.get_rank()))
            self.ops.append(op)
        else:
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True,
                                                     group=self.process_group)

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            if not self.asynchronous:
                return
            if not self._started:
                # The backend runs each async op once: that starts its rounds.
                bagua_ddp.mark_unready_tensors()
                bagua_ddp.wait_pending_comm_ops()
                self._started = True
            for op in self.ops:
                op.rethrow_failure()
            # Still locked: not every optimizer stepped last iteration. Taking
            # the lock again lets the background thread's pending work run.
            self.unlock(bagua_ddp)
            # Bounded staleness: wait for a round without the lock (the
            # background threads service the round themselves meanwhile).
            for op in self.ops:
                op.wait_within_staleness()
            self.lock(bagua_ddp)

        return hook

    # Asynchronous: the background thread averages the weights, nothing is
    # communicated during backward. Warmup: GradientAllReduce's hooks.
    def init_backward_hook(self, bagua_ddp):
        return do_nothing if self.asynchronous else super().init_backward_hook(bagua_ddp)

    def init_post_backward_hook(self, bagua_ddp):
        return do_nothing if self.asynchronous else super().init_post_backward_hook(bagua_ddp)

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            self.steps_done = bagua_ddp.step_counter
            # The weights are the optimizers' until the last of them stepped.
            self._stepped.add(id(optimizer))
            if self._locked and self._stepped.issuperset(id(o) for o in bagua_ddp.optimizers):
                for op in self.ops:
                    op.count_step()  # one local step, whatever the number of optimizers
                self.unlock(bagua_ddp)

        return hook

    def init_inference_forward_hooks(self, bagua_ddp):
        # An evaluation forward reads the weights too: hold the lock during
        # it, unless training holds it already.
        taken = []

        def before(inputs):
            if self.asynchronous and self._started and not self._locked:
                self.lock(bagua_ddp)
                taken.append(True)

        def after(output):
            if taken:
                taken.clear()
                self.unlock(bagua_ddp)

        return before, after

    def lock(self, bagua_ddp) -> None:
        if not self._locked:
            stream = self._training_stream(bagua_ddp)
            for op in self.ops:
                op.lock_weight(cuda_stream=stream)
            self._locked = True
            self._stepped.clear()

    def unlock(self, bagua_ddp) -> None:
        if self._locked:
            stream = self._training_stream(bagua_ddp)
            for op in reversed(self.ops):
                op.unlock_weight(cuda_stream=stream)
            self._locked = False

    @staticmethod
    def _training_stream(bagua_ddp):
        """CUDA weights: the stream training runs on, so the background
        averaging is ordered with its kernels (None for CPU weights)."""
        for param in bagua_ddp.module.parameters():
            if param.is_cuda:
                return torch.cuda.current_stream(param.device).cuda_stream
            return None
        return None

    def abort(self, bagua_ddp, average: bool = False) -> None:
        self.unlock(bagua_ddp)
        for op in self.ops:
            op.abort()
        if average:
            self.average_weights(bagua_ddp)

    def average_weights(self, bagua_ddp) -> None:
        """One synchronous average of every rank's weights (collective; the
        background rounds are stopped). Optimizer states stay local."""
        groups = {}  # one allreduce per dtype and device, in the same order on every rank
        for _, p in bagua_ddp.bagua_build_params():
            groups.setdefault((str(p.dtype), str(p.device)), []).append(p)
        comm = self.process_group.get_global_communicator()
        with torch.no_grad():
            for key in sorted(groups):
                params = groups[key]
                flat = torch.cat([p.data.reshape(-1) for p in params])
                allreduce_inplace(flat, op=ReduceOp.AVG, comm=comm)
                offset = 0
                for p in params:
                    p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def resume(self, bagua_ddp) -> None:
        for op in self.ops:
            op.resume()

    def shutdown(self, bagua_ddp) -> None:
        # The background thread must not outlive the wrapping: it would keep
        # averaging (and keep peers waiting on it) and write weights the
        # module may free. Aborting on one rank stops every rank's rounds.
        try:
            self.abort(bagua_ddp)
        except BaguaError as error:  # e.g. a peer that is gone: nothing left to stop with
            logging.getLogger(__name__).warning("asynchronous model average: stopping at shutdown: %s", error)

    def status(self) -> List[str]:
        return [op.get_status() for op in self.ops]

    def stats(self) -> dict:
        """This rank's rounds so far, summed over the buckets' ops (each
        bucket averages on its own thread); per-op figures under "buckets"."""
        per_op = [op.stats() for op in self.ops]
        rounds = min((s["rounds"] for s in per_op), default=0)
        drift_sq = sum(s["last_drift_sq"] for s in per_op)
        average_sq = sum(s["last_average_sq"] for s in per_op)

        def mean(key, count_key="rounds"):
            values = [s[key] / s[count_key] for s in per_op if s[count_key] > 0]
            return sum(values) / len(values) if values else 0.0

        return {
            "max_staleness_steps": self.max_staleness_steps,
            "steps": max((s["steps"] for s in per_op), default=0),
            "rounds": rounds,
            "steps_per_round": {"last": max((s["last_round_steps"] for s in per_op), default=0),
                                "mean": mean("steps_in_rounds"),
                                "max": max((s["max_round_steps"] for s in per_op), default=0)},
            "round_ms": {"last": max((s["last_round_ms"] for s in per_op), default=0.0),
                         "mean": mean("total_round_ms"),
                         "max": max((s["max_round_ms"] for s in per_op), default=0.0)},
            # distance (L2, all weights) of this rank's snapshot to the average
            # of the last round of each bucket
            "drift": math.sqrt(drift_sq),
            "relative_drift": math.sqrt(drift_sq / average_sq) if average_sq > 0 else 0.0,
            "max_drift": math.sqrt(sum(s["max_drift_sq"] for s in per_op)),
            "staleness_waits": sum(s["staleness_waits"] for s in per_op),
            "staleness_wait_ms": sum(s["staleness_wait_ms"] for s in per_op),
            "buckets": per_op,
        }


class AsyncModelAverageAlgorithm(Algorithm):
    impl_class = AsyncModelAverageAlgorithmImpl

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0, max_staleness_steps: Optional[int] = DEFAULT_MAX_STALENESS_STEPS):
        """
        Args:
            peer_selection_mode: "all" (the only mode: average over all ranks).
            sync_interval_ms: milliseconds between two background averaging rounds.
            warmup_steps: synchronous GradientAllReduce steps before going asynchronous.
            max_staleness_steps: local steps a rank may take since its last
                completed averaging round before it waits for the next one;
                None: never wait (Bagua's behaviour, drift set by the machine's
                timing). Smaller is closer to synchronous training and slower.
        """
        check = ArgumentChecks(type(self).__name__)
        check.choice("peer_selection_mode", peer_selection_mode, ("all",))
        check.integer("sync_interval_ms", sync_interval_ms, 0)
        check.integer("warmup_steps", warmup_steps, 0)
        if max_staleness_steps is not None:
            check.integer("max_staleness_steps", max_staleness_steps, 1,
                          " (None: unbounded)")
        self.keep_settings(peer_selection_mode=peer_selection_mode, sync_interval_ms=sync_interval_ms,
                           warmup_steps=warmup_steps, max_staleness_steps=max_staleness_steps)

    def abort(self, bagua_module, average: bool = False) -> None:
        """Stops the background averaging on every rank (collective in effect:
        the ranks agree at their next round). Training goes on locally.

        average: then average the weights once, synchronously, so that every
        rank holds the same model (collective: every rank must call
        ``abort(model, average=True)``). Optimizer states are not averaged."""
        ArgumentChecks(type(self).__name__ + ".abort").flags(average=average)
        bagua_module.bagua_ddp.bagua_algorithm_impl.abort(bagua_module.bagua_ddp, average=average)

    def stats(self, bagua_module) -> dict:
        """This rank's averaging rounds so far: ``steps_per_round``,
        ``round_ms`` (each with last, mean, max), ``drift`` (L2 distance of
        this rank's weights to the last round's average), ``relative_drift``
        (drift / norm of the average), ``max_drift``, ``staleness_waits`` and
        ``staleness_wait_ms`` (time spent waiting for the bound), ``rounds``,
        ``steps``, and the per-bucket figures. Zeros before the first round."""
        return bagua_module.bagua_ddp.bagua_algorithm_impl.stats()

    def resume(self, bagua_module) -> None:
        """Starts the background averaging again; every rank calls it."""
        bagua_module.bagua_ddp.bagua_algorithm_impl.resume(bagua_module.bagua_ddp)
