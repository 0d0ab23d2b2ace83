"""Bagua's gradient compression inside PyTorch's own DistributedDataParallel,
as DDP communication hooks (for stacks that wrap DDP themselves: Hugging
Face's Trainer, Accelerate, Lightning's DDP strategy, a plain script)::

    import bagua.torch_api as bagua
    from bagua.torch_api import ddp_hooks

    bagua.init_process_group()          # joins torch.distributed's store
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp_hooks.ByteGradState()   # collective
    ddp.register_comm_hook(state, ddp_hooks.bytegrad_hook)

``bytegrad_hook`` runs ByteGrad's op, the same C++ (or CUDA) code as
``ByteGradAlgorithm(hierarchical=False)`` under ``with_bagua``: each DDP
bucket in n chunks, each chunk 8-bit MinMaxUInt8 (its own min and max), an
alltoall, each rank decompressing and averaging its chunk, compressing it
again, an allgather, decompressing: about a quarter of the bytes of DDP's
float32 allreduce. On the same bucket it gives with_bagua's result bit for
bit (tests/python/test_ddp_hooks.py).

How it runs: DDP calls the hook for its buckets in index order on the
backward's thread; the hook hands each bucket to one communication thread
of the state's own and returns a future that thread completes. The thread
runs the buckets in the order it received them over bagua's communicator
of the DDP's ranks (a connection of the state's own, see
``process_group.EngineGroup``), so every rank issues the same sequence and
the backward goes on meanwhile.
"""

import queue
import threading
from typing import Dict

import torch

from bagua.torch_api._core import InvalidArgumentError, core, tensor_view

__all__ = ["ByteGradState", "bytegrad_hook"]


class _HookBucket:
    """One DDP bucket's copy, its bagua bucket with the op and the backend
    that runs it."""

    def __init__(self, name: str, like: torch.Tensor, append_op, rank: int):
        self.name = name
        self.flat = torch.zeros_like(like)
        self.bucket = core.Bucket(name, [(name, tensor_view(self.flat, allow_cuda=True))])
        append_op(self.bucket)
        self.backend = core.Backend(rank)
        self.backend.register_ordered_buckets([self.bucket])

    def run(self, values: torch.Tensor) -> torch.Tensor:
        self.flat.copy_(values)
        if self.flat.is_cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()
        self.backend.mark_communication_ready(self.name)
        self.backend.wait_pending_comm_ops()
        return self.flat


class _HookState:
    """What every bagua DDP hook keeps: bagua's group of the DDP's ranks,
    the communication thread and one _HookBucket per DDP bucket."""

    def __init__(self, process_group=None):
        from bagua.torch_api.data_parallel.distributed import to_bagua_process_group
        from bagua.torch_api.process_group import is_initialized

        if not is_initialized():
            raise InvalidArgumentError(f"{type(self).__name__} needs bagua's process group: call "
                                       "bagua.torch_api.init_process_group() first (it joins torch's)")
        group = to_bagua_process_group(process_group)
        if not group.is_member():
            raise InvalidArgumentError(f"{type(self).__name__}: this rank is not in the DDP's process group")
        self.group = group.engine_group()  # connections of its own
        self._buckets: Dict[tuple, _HookBucket] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="bagua-ddp-hook", daemon=True)
        self._thread.start()

    def append_op(self, bucket) -> None:
        raise NotImplementedError

    def submit(self, grad_bucket) -> torch.futures.Future:
        values = grad_bucket.buffer()
        key = (grad_bucket.index(), values.numel(), values.dtype, values.device)
        future: torch.futures.Future = torch.futures.Future()
        self._queue.put((key, values, future))
        return future

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, values, future = item
            try:
                hook_bucket = self._buckets.get(key)
                if hook_bucket is None:
                    # DDP rebuilds its buckets after the first iteration: a
                    # new index or size gets a bagua bucket of its own.
                    hook_bucket = self._buckets[key] = _HookBucket(
                        f"ddp_bucket{key[0]}_{key[1]}", values, self.append_op, self.group.get_rank())
                future.set_result(hook_bucket.run(values))
            except BaseException as error:  # noqa: BLE001 - DDP rethrows it where it waits
                future.set_exception(error)

    def __del__(self):
        try:
            self._queue.put(None)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} holds communicators: save state_dict() instead")


class ByteGradState(_HookState):
    """State of :func:`bytegrad_hook` for a DDP over ``process_group``
    (None: the default group). Collective: every rank of the group creates
    it. ``average``: average the gradients (DDP's convention) or sum them."""

    def __init__(self, process_group=None, average: bool = True):
        if not isinstance(average, bool):
            raise InvalidArgumentError(f"ByteGradState: average must be a bool, got {average!r}")
        self.average = average
        super().__init__(process_group)

    def append_op(self, bucket) -> None:
        bucket.append_centralized_low_precision_op(
            self.group.get_bucket_communicator(), None,
            core.CentralizedLowPrecisionOptions(hierarchical=False, average=self.average, error_feedback=False))

    def state_dict(self) -> dict:
        """Nothing to save: ByteGrad keeps no state between steps."""
        return {"hook": "bytegrad"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("hook") != "bytegrad":
            raise InvalidArgumentError(f"ByteGradState.load_state_dict: a {state.get('hook')!r} hook's state")


def bytegrad_hook(state: ByteGradState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ByteGrad's 8-bit scatter-reduce and allgather
    of the bucket (see the module docstring). Floating-point buckets only."""
    if not bucket.buffer().is_floating_point():
        raise InvalidArgumentError(f"bytegrad_hook: bucket {bucket.index()} holds {bucket.buffer().dtype}")
    return state.submit(bucket)
