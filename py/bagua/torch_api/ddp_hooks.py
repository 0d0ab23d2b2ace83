"""Bagua's gradient compression inside PyTorch's own DistributedDataParallel,
as DDP communication hooks (for stacks that wrap DDP themselves: Hugging
Face's Trainer, Accelerate, Lightning's DDP strategy, a plain script)::

    import bagua.torch_api as bagua
    from bagua.torch_api import ddp_hooks

    bagua.init_process_group()          # joins torch.distributed's store
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp_hooks.ByteGradState(model)   # collective
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

from bagua.torch_api._core import InvalidArgumentError, core, device_name, dtype_name, tensor_view

__all__ = ["ByteGradState", "bytegrad_hook", "PowerSGDState", "powersgd_hook"]


class _HookBucket:
    """One DDP bucket's gradients copied into a flat tensor of its own, in
    bagua's order (reverse module order, what with_bagua's first buckets
    hold) whatever order DDP's bucket has (module order in its first
    iteration, ready order after it rebuilt): so the op's layout, and its
    8-bit chunks, are the same before and after DDP rebuilds or a resume.
    Where DDP's order already is bagua's (its buckets after the rebuild,
    as a rule) the op works on DDP's buffer itself: no copy in or out (two
    passes over the bucket, 8-19 ms a step for 17 MB on 2 shared cores).
    Its bagua bucket holds the op; the backend runs it."""

    def __init__(self, name: str, values: torch.Tensor, shapes, names, order, append_op, rank: int):
        self.name = name
        self.order = order  # our position i holds DDP's gradient order[i]
        self.in_place = in_place(values, order)
        self.flat = values if self.in_place else torch.zeros(values.numel(), dtype=values.dtype,
                                                             device=values.device)
        self.shapes = [shapes[i] for i in order]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.views = self._views_of(self.flat)
        self.names = [f"{name}/{names[i]}" for i in order]
        self.bucket = core.Bucket(name, [(n, tensor_view(v, allow_cuda=True)) for n, v in zip(self.names, self.views)])
        self.op = append_op(self.bucket, self.views, [names[i] for i in order])
        self.backend = core.Backend(rank)
        self.backend.register_ordered_buckets([self.bucket])

    def _views_of(self, flat: torch.Tensor):
        return [v.view(s) for v, s in zip(flat.split(self.numels), self.shapes)]

    def _rebind(self, values: torch.Tensor) -> None:
        """The op, in place, works on ``values`` from now on: another buffer
        of the same layout (DDP's zero buckets for a rank that has joined,
        a bucket DDP rebuilt the same). The op and its state stay: every rank
        keeps running the same ops in the same order."""
        self.flat = values  # holds the memory while the op's views point at it
        self.views = self._views_of(values)
        for name, view in zip(self.names, self.views):
            self.backend.rebind_tensor(name, tensor_view(view, allow_cuda=True))

    def run(self, values: torch.Tensor, gradients) -> torch.Tensor:
        if self.in_place and values.data_ptr() != self.flat.data_ptr():
            self._rebind(values)
        if not self.in_place:
            for view, i in zip(self.views, self.order):
                view.copy_(gradients[i])
        if self.flat.is_cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()
        for name in self.names:
            self.backend.mark_communication_ready(name)
        self.backend.wait_pending_comm_ops()
        if not self.in_place:
            for view, i in zip(self.views, self.order):
                gradients[i].copy_(view)  # back into DDP's bucket, in its order
        return values


def in_place(values: torch.Tensor, order) -> bool:
    """Whether the op can work on DDP's bucket buffer itself: its
    gradients already in bagua's order, the buffer one dense block."""
    return list(order) == list(range(len(order))) and values.is_contiguous() and values.dim() == 1


def _check_ddp_groups(state: str, module: torch.nn.Module, ranks: list) -> None:
    """A DDP that already wraps ``module`` over other ranks than the state's
    group is an error: the hook would average its buckets with ranks outside
    the DDP's group (other data-parallel groups), silently. Local, before
    anything collective, so every rank that made the mistake raises."""
    import gc

    from bagua.torch_api._compat_communication import _torch_group_ranks

    # The DDPs alive now: one pass over the collector's objects, once per
    # state (0.12 s with transformers and a GPT-2 loaded, 511 000 objects).
    # By type, not isinstance: that would read every object's __class__,
    # and some objects warn when read. A state made before its DDP is not
    # checked.
    classes, pending = set(), [torch.nn.parallel.DistributedDataParallel]
    while pending:
        cls = pending.pop()
        classes.add(cls)
        pending.extend(cls.__subclasses__())
    for ddp in gc.get_objects():
        if type(ddp) in classes and ddp.module is module:
            theirs = _torch_group_ranks(ddp.process_group)
            if theirs != ranks:
                raise InvalidArgumentError(
                    f"{state}: the DDP around this module communicates over ranks {theirs}, the state "
                    f"over ranks {ranks}: the hook would average with ranks outside the DDP's group. "
                    f"Pass process_group=ddp.process_group (ddp_hooks.register(ddp, ...) does)")


class _HookState:
    """What every bagua DDP hook keeps: bagua's group of the DDP's ranks,
    the communication thread and one _HookBucket per DDP bucket.
    ``append_op(bucket, views, names)`` (the hook's own) adds the op."""

    def __init__(self, process_group=None, module=None):
        from bagua.torch_api.data_parallel.distributed import to_bagua_process_group
        from bagua.torch_api.process_group import is_initialized

        if not is_initialized():
            raise InvalidArgumentError(f"{type(self).__name__} needs bagua's process group: call "
                                       "bagua.torch_api.init_process_group() first (it joins torch's)")
        group = to_bagua_process_group(process_group)
        if not group.is_member():
            raise InvalidArgumentError(f"{type(self).__name__}: this rank is not in the DDP's process group")
        if module is not None:
            _check_ddp_groups(type(self).__name__, module, list(group.ranks))
        self.group = group.engine_group()  # connections of its own
        # The ops' connection too, now, on the training thread: made on the
        # communication thread at the first bucket, two states' threads
        # rendezvous through torch's store at once, which on torch 1.13 timed
        # out in the first backward of two hooked DDPs (test_ddp_hooks.py).
        self.group.get_bucket_communicator()
        # Parameter names (the module's, for state keyed by name), else positions.
        named = list(module.named_parameters()) if module is not None else []
        self._names = {id(p): n for n, p in named}
        self._positions = {id(p): i for i, (_, p) in enumerate(named)}
        self._buckets: Dict[tuple, _HookBucket] = {}
        # buckets run on DDP's buffer itself and through a copy (a check of
        # the fast path, read by tests and benchmarks)
        self.bucket_runs = {"in_place": 0, "copied": 0}
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="bagua-ddp-hook", daemon=True)
        self._thread.start()

    def append_op(self, bucket, views, names):
        raise NotImplementedError

    def iteration_starts(self) -> None:
        """Before the first bucket of a backward (on the communication thread)."""

    def submit(self, grad_bucket) -> torch.futures.Future:
        values = grad_bucket.buffer()
        params = grad_bucket.parameters()
        shapes = [tuple(p.shape) for p in params]
        names = [self._names.get(id(p), f"{grad_bucket.index()}.{i}") for i, p in enumerate(params)]
        # bagua's order: reverse module order (without the module: DDP's own)
        order = sorted(range(len(params)), key=lambda i: -self._positions.get(id(params[i]), -i))
        # The layout, not the buffer: a bucket of the same layout in another
        # buffer (DDP's zero buckets on a rank that has joined, under
        # torch.distributed.algorithms.join.Join) runs the same op, moved to
        # that buffer (_HookBucket.run). A new op on one rank only would set
        # the ranks' ops out of step: its once-per-op check (ByteGrad's
        # segments) met the other ranks' data, a refusal and then a hang.
        key = (grad_bucket.index(), values.numel(), values.dtype, values.device, tuple(names))
        future: torch.futures.Future = torch.futures.Future()
        self._queue.put((key, values, grad_bucket.gradients(), shapes, names, order, grad_bucket.index() == 0,
                         future))
        return future

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, values, gradients, shapes, names, order, first, future = item
            try:
                if first:
                    self.iteration_starts()
                hook_bucket = self._buckets.get(key)
                if hook_bucket is None:
                    # DDP rebuilds its buckets after the first iteration: a
                    # new index or layout gets a bagua bucket of its own, in
                    # place of the index's old one (on every rank alike).
                    self._buckets = {k: b for k, b in self._buckets.items() if k[0] != key[0]}
                    hook_bucket = self._buckets[key] = _HookBucket(
                        f"ddp_bucket{key[0]}_{key[1]}", values, shapes, names, order, self.append_op,
                        self.group.get_rank())
                self.bucket_runs["in_place" if hook_bucket.in_place else "copied"] += 1
                future.set_result(hook_bucket.run(values, gradients))
            except BaseException as error:  # noqa: BLE001 - DDP rethrows it where it waits
                future.set_exception(error)

    def _forget_buckets(self) -> None:
        """The ops are made again at their next use (a loaded state)."""
        self._buckets = {}

    def __del__(self):
        try:
            self._queue.put(None)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} holds communicators: save state_dict() instead")


class ByteGradState(_HookState):
    """State of :func:`bytegrad_hook` for a DDP over ``process_group``
    (None: the default group). ``module``: the DDP's module, whose order the
    op's layout follows (reverse module order, as with_bagua's; without it,
    the order of DDP's bucket). Collective: every rank of the group creates
    it. ``average``: average the gradients (DDP's convention) or sum them."""

    def __init__(self, module: torch.nn.Module = None, process_group=None, average: bool = True):
        if not isinstance(average, bool):
            raise InvalidArgumentError(f"ByteGradState: average must be a bool, got {average!r}")
        self.average = average
        super().__init__(process_group, module)

    def append_op(self, bucket, views, names):
        return bucket.append_centralized_low_precision_op(
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


class PowerSGDState(_HookState):
    """State of :func:`powersgd_hook`: with_bagua's PowerSGD (its C++ op:
    the factor passes, Gram-Schmidt, both exchanges; ``low_precision=True``
    sends the factors 8-bit) for a DDP over ``process_group``. ``module``
    (the DDP's module) names the parameters, so Q and the error feedback
    are kept by name as with_bagua keeps them (the same first Q, the same
    checkpoints). The arguments are PowerSGDAlgorithm's. Collective."""

    def __init__(self, module: torch.nn.Module, process_group=None, rank: int = 1, start_iter: int = 10,
                 min_compression_rate: float = 2.0, error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0, low_precision: bool = False):
        from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError("PowerSGDState: module must be the DDP's torch.nn.Module (it names "
                                       f"the parameters), got {type(module).__name__}")
        # The algorithm checks the arguments; its implementation keeps Q and
        # the errors by name and draws the first Q, as under with_bagua.
        self.algorithm = PowerSGDAlgorithm(rank=rank, start_iter=start_iter, min_compression_rate=min_compression_rate,
                                           error_feedback=error_feedback, warm_start=warm_start,
                                           orthogonalization_epsilon=orthogonalization_epsilon, seed=seed,
                                           low_precision=low_precision)
        self.iteration = 0  # backwards started, the current one included
        super().__init__(process_group, module)
        self.impl = self.algorithm.reify(self.group)

    @property
    def compressing(self) -> bool:
        return self.iteration > self.impl.start_iter

    def iteration_starts(self) -> None:
        self.iteration += 1
        impl = self.impl
        if self.compressing and not impl.warm_start:
            if impl._q_used:  # a fresh Q every step after the first, as with_bagua's
                for name, q in impl._q.items():
                    q.copy_(impl._draw_q(name, q.shape[0], q.dtype, q.device))
            impl._q_used = True
        for hook_bucket in self._buckets.values():
            hook_bucket.op.compressing = self.compressing

    def append_op(self, bucket, views, names):
        from bagua.torch_api.algorithms.powersgd import compresses

        impl, matrices, deferred = self.impl, [], []
        for index, (grad, name) in enumerate(zip(views, names)):
            if not compresses(grad.shape, impl.rank, impl.min_compression_rate):
                continue
            m = grad.reshape(grad.shape[0], -1)
            error = impl._state(impl._error, name, m) if impl.error_feedback else None
            q = impl._q_for(name, m)
            no_error = core.TensorView(0, 0, dtype_name(grad.dtype), device_name(grad.device))
            matrices.append((index, m.shape[0], m.shape[1], tensor_view(q, allow_cuda=True),
                             no_error if error is None else tensor_view(error, allow_cuda=True)))
            kept = impl._deferred_for(name, error)  # the error deferred on host memory
            if kept:
                deferred.append(tuple(tensor_view(t) for t in kept))
        op = bucket.append_powersgd_op(self.group.get_bucket_communicator(), matrices, core.PowerSGDOptions(
            rank=impl.rank, low_precision=impl.low_precision, orthogonalization_epsilon=impl.epsilon), deferred)
        op.compressing = self.compressing
        return op

    def state_dict(self) -> dict:
        """Q and the error feedback by parameter name, and the iteration: a
        state loaded from it resumes bit for bit."""
        return {"hook": "powersgd", "iteration": self.iteration, "algorithm_state": self.impl.state_dict(None)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("hook") != "powersgd":
            raise InvalidArgumentError(f"PowerSGDState.load_state_dict: a {state.get('hook')!r} hook's state")
        self.iteration = int(state["iteration"])
        self.impl.load_state_dict(None, state["algorithm_state"])
        self._forget_buckets()


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: with_bagua's PowerSGD op on the bucket (rank-r
    factors of each matrix, error feedback, warm-started Q; vectors and the
    first ``start_iter`` iterations averaged uncompressed). With
    ``PowerSGDState(..., low_precision=True)``, 8-bit PowerSGD."""
    if not bucket.buffer().is_floating_point():
        raise InvalidArgumentError(f"powersgd_hook: bucket {bucket.index()} holds {bucket.buffer().dtype}")
    return state.submit(bucket)


_HOOKS = {"bytegrad": (ByteGradState, bytegrad_hook), "powersgd": (PowerSGDState, powersgd_hook)}


def register(ddp, hook: str = "bytegrad", **options):
    """Registers bagua's ``hook`` ("bytegrad" or "powersgd"; PowerSGD's
    options as ``PowerSGDState``'s, e.g. ``low_precision=True``) on ``ddp``,
    a ``torch.nn.parallel.DistributedDataParallel`` (what
    ``accelerator.prepare(model)`` returns under Accelerate's multi-process
    CPU or GPU setup). Returns the state (its ``state_dict()`` goes into
    checkpoints). Collective."""
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise InvalidArgumentError(f"ddp_hooks.register needs a torch DistributedDataParallel, got "
                                   f"{type(ddp).__name__} (a single process needs no hook)")
    if hook not in _HOOKS:
        raise InvalidArgumentError(f"ddp_hooks.register: hook must be one of {sorted(_HOOKS)}, got {hook!r}")
    state_class, function = _HOOKS[hook]
    state = state_class(ddp.module, process_group=ddp.process_group, **options)
    ddp.register_comm_hook(state, function)
    return state
