"""Asynchronous model average: every rank trains at its own pace while a
background thread averages the weights of all ranks every
``sync_interval_ms``. A slow rank no longer stalls the others.

For the first ``warmup_steps`` steps it is GradientAllReduce (synchronous),
then the weights are averaged asynchronously. ``abort(model)`` stops the
background averaging on every rank (agreed at the next round, so ranks that
ran different numbers of steps stop cleanly; training goes on locally) and
``resume(model)`` (called by every rank) starts it again.
"""

import contextlib
import logging
from typing import List

import torch

from bagua.torch_api import BaguaError
from bagua.torch_api.algorithms.base import (
    Algorithm,
    AlgorithmImpl,
    check_choice,
    check_integer,
    do_nothing,
    weight_tensors,
)

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0):
        super().__init__(process_group)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
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
            self.ops.append(bucket.append_asynchronous_model_average_op(
                peer_selection_mode=self.peer_selection_mode, group=self.process_group,
                sync_interval_ms=self.sync_interval_ms))
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
            if self._stepped.issuperset(id(o) for o in bagua_ddp.optimizers):
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

    def abort(self, bagua_ddp) -> None:
        self.unlock(bagua_ddp)
        for op in self.ops:
            op.abort()

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


class AsyncModelAverageAlgorithm(Algorithm):
    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0):
        """
        Args:
            peer_selection_mode: "all" (the only mode: average over all ranks).
            sync_interval_ms: milliseconds between two background averaging rounds.
            warmup_steps: synchronous GradientAllReduce steps before going asynchronous.
        """
        check_choice(type(self).__name__, "peer_selection_mode", peer_selection_mode, ("all",))
        check_integer(type(self).__name__, "sync_interval_ms", sync_interval_ms, 0)
        check_integer(type(self).__name__, "warmup_steps", warmup_steps, 0)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, process_group) -> AsyncModelAverageAlgorithmImpl:
        return AsyncModelAverageAlgorithmImpl(process_group, self.peer_selection_mode,
                                              self.sync_interval_ms, self.warmup_steps)

    def abort(self, bagua_module) -> None:
        """Stops the background averaging on every rank (collective in effect:
        the ranks agree at their next round). Training goes on locally."""
        bagua_module.bagua_ddp.bagua_algorithm_impl.abort(bagua_module.bagua_ddp)

    def resume(self, bagua_module) -> None:
        """Starts the background averaging again; every rank calls it."""
        bagua_module.bagua_ddp.bagua_algorithm_impl.resume(bagua_module.bagua_ddp)
