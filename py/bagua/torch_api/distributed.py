"""``with_bagua``: wrapping a module for distributed training.

``model.with_bagua([optimizer], algorithm)`` returns the same module object,
now also a :class:`BaguaModule`. What happens, in order:

1. Parameters, buffers and optimizer state are broadcast from rank 0.
2. The algorithm is reified for the process group; its ``init_tensors`` says
   which tensors to communicate (gradients, weights...).
3. Buckets are planned: first in reverse parameter order (the usual gradient
   ready order); after the first iteration, in the order the tensors actually
   became ready on rank 0 (the profile), up to BAGUA_DEFAULT_BUCKET_SIZE bytes
   each. Every rank applies rank 0's plan, so all ranks bucket identically.
4. Hooks drive a training step: forward pre-hook, one hook per parameter after
   its gradient is accumulated, a callback at the end of backward, and one
   after each ``optimizer.step()``; each calls the algorithm's hook.
"""

import itertools
import os
import weakref
from typing import Dict, List, Optional

import torch

from bagua.torch_api import env
from bagua.torch_api._core import InvalidArgumentError, core, dtype_name, log
from bagua.torch_api.communication import (
    BaguaProcessGroup,
    _get_default_group,
    broadcast,
    is_initialized,
)
from bagua.torch_api import autotune as autotune_module
from bagua.torch_api import timeline
from bagua.torch_api.tensor import BaguaTensor

_module_ids = itertools.count()


class BaguaDistributedDataParallel:
    """The engine behind a wrapped module (``model.bagua_ddp``)."""

    def __init__(self, module: torch.nn.Module, optimizers, algorithm, process_group, do_flatten: bool,
                 overlap: bool = True, autotune: Optional[bool] = None):
        from bagua.torch_api.algorithms import Algorithm

        if not isinstance(algorithm, Algorithm):
            raise InvalidArgumentError(
                f"with_bagua: algorithm must be a bagua Algorithm, got {type(algorithm).__name__}")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        if not isinstance(optimizers, (list, tuple)) or not all(
                isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise InvalidArgumentError("with_bagua: optimizers must be a list of torch.optim.Optimizer")
        for name, value in (("do_flatten", do_flatten), ("overlap", overlap)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"with_bagua: {name} must be a bool, got {value!r}")
        if autotune is not None and not isinstance(autotune, bool):
            raise InvalidArgumentError(f"with_bagua: autotune must be a bool or None, got {autotune!r}")
        self.overlap = overlap
        self._deferred_grads = []
        self.module = module
        self.optimizers = list(optimizers)
        self.bagua_algorithm = algorithm
        self.process_group: BaguaProcessGroup = process_group or _get_default_group()
        self.do_flatten = do_flatten
        self.bagua_module_name = f"{type(module).__name__}_{next(_module_ids)}"
        self.bucket_bytes = env.get_default_bucket_size()
        if self.bucket_bytes <= 0:
            raise InvalidArgumentError(f"BAGUA_DEFAULT_BUCKET_SIZE must be positive, got {self.bucket_bytes}")

        self._broadcast_states()
        self.bagua_algorithm_impl = algorithm.reify(self.process_group)
        self._timeline = timeline.get(self.process_group.get_rank())
        self._bagua_backend = core.Backend(self.process_group.get_rank(), env.get_comm_timeout_s(),
                                           self._timeline)
        self._phase_start = {}
        self.bagua_buckets = []
        self.bagua_tensors: List[BaguaTensor] = []
        self._tensors_by_name: Dict[str, BaguaTensor] = {}
        self._marked = set()
        self._profiled = False
        self._pending_order: Optional[List[str]] = None
        self._callback_queued = False
        self._handles = []
        self._wrapped_steps = []
        self.step_counter = 0
        self.autotuner = None
        initial_order = None
        plan_path = os.environ.get("BAGUA_AUTOTUNE_PLAN")
        if plan_path:
            plan = autotune_module.load_plan(plan_path)
            self.bucket_bytes = plan["bucket_bytes"]
            initial_order = plan.get("order")
            self._profiled = True  # the saved plan carries the order
        elif autotune_module.enabled(autotune):
            self.autotuner = autotune_module.Autotuner(self, self.bucket_bytes)
        self._reset_algorithm_buckets(initial_order)
        self._install_hooks()

    # -- parameters and state ---------------------------------------------
    def bagua_build_params(self):
        """(name, parameter) pairs to train, in module order, shared ones once."""
        seen = set()
        params = []
        for name, param in self.module.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append((name, param))
        return params

    def _broadcast_states(self) -> None:
        tensors = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    for key in sorted(optimizer.state.get(p, {})):
                        value = optimizer.state[p][key]
                        if isinstance(value, torch.Tensor):
                            tensors.append(value)
        _broadcast_coalesced(tensors, self.process_group)

    # -- buckets ------------------------------------------------------------
    def _reset_algorithm_buckets(self, order: Optional[List[str]] = None) -> None:
        impl = self.bagua_algorithm_impl
        self.bagua_tensors = impl.init_tensors(self)
        names = [t.name for t in self.bagua_tensors]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"{type(impl).__name__}.init_tensors returned duplicate names")
        self._tensors_by_name = {t.name: t for t in self.bagua_tensors}
        if order is not None and sorted(order) == sorted(names):
            ordered = [self._tensors_by_name[n] for n in order]
        else:
            ordered = list(self.bagua_tensors)
        declarations = [(t.name, t.current().numel(), dtype_name(t.current().dtype),
                         _device_name(t.current().device)) for t in ordered]
        plan = core.plan_buckets(declarations, self.bucket_bytes)
        grouped = [[ordered[i] for i in bucket] for bucket in plan]
        self.bagua_buckets = impl.tensors_to_buckets(grouped, self.do_flatten)
        for bucket in self.bagua_buckets:
            impl.init_operations(self, bucket)
        for tensor in self.bagua_tensors:
            tensor._attach_backend(self._bagua_backend, self._marked.add)
        self._verify_same_buckets()
        self._bagua_backend.register_ordered_buckets([b.backend_bucket for b in self.bagua_buckets])
        self._marked.clear()
        if self.process_group.get_rank() == 0:
            log("info", f"{self.bagua_module_name}: {len(self.bagua_buckets)} buckets "
                        f"({', '.join(str(len(b.tensors)) for b in self.bagua_buckets)} tensors), "
                        f"target {self.bucket_bytes} bytes, flatten={self.do_flatten}")

    def _verify_same_buckets(self) -> None:
        """Every rank must register the same buckets: compare a digest."""
        import zlib

        layout = ";".join(f"{b.name}:" + ",".join(f"{t.name}/{t.bagua_registered_tensor().numel()}"
                                                  for t in b.tensors) for b in self.bagua_buckets)
        digest = torch.tensor([len(self.bagua_buckets), zlib.crc32(layout.encode())], dtype=torch.int64)
        comm = self.process_group.get_global_communicator()
        if comm.size == 1:
            return
        gathered = torch.zeros(2 * comm.size, dtype=torch.int64)
        from bagua.torch_api.communication import allgather

        allgather(digest, gathered, comm=self.process_group)
        rows = gathered.view(comm.size, 2).tolist()
        if any(row != rows[0] for row in rows):
            raise InvalidArgumentError(
                f"rank {comm.rank}: ranks built different buckets (per rank [count, digest]: {rows}); "
                "every rank must wrap the same model with the same algorithm")

    def _adopt_profiled_order(self) -> None:
        """After the first iteration: plan buckets by rank 0's ready order."""
        order = self._bagua_backend.last_ready_order()
        names = [t.name for t in self.bagua_tensors]
        index = {name: i for i, name in enumerate(names)}
        if sorted(order) != sorted(names):
            return  # not a full profile (e.g. weights marked by the algorithm)
        positions = torch.tensor([index[n] for n in order], dtype=torch.int64)
        broadcast(positions, 0, comm=self.process_group)
        rank0_order = [names[i] for i in positions.tolist()]
        current = [t.name for b in self.bagua_buckets for t in b.tensors]
        if rank0_order != current:
            self._pending_order = rank0_order

    # -- hooks ----------------------------------------------------------------
    def _install_hooks(self) -> None:
        impl = self.bagua_algorithm_impl
        self_ref = weakref.ref(self)

        def forward_pre_hook(module, inputs):
            ddp = self_ref()
            if ddp is not None:
                ddp._on_forward(inputs)

        self._handles.append(self.module.register_forward_pre_hook(forward_pre_hook))
        if self._timeline is not None:
            def forward_hook(module, inputs, output):
                ddp = self_ref()
                if ddp is not None:
                    ddp._end_phase("forward")

            self._handles.append(self.module.register_forward_hook(forward_hook))
        self._grad_accumulators = []
        for name, param in self.bagua_build_params():
            self._register_grad_hook(name, param, self_ref)
        for optimizer in self.optimizers:
            self._wrap_step(optimizer, self_ref)
        self._backward_hook = impl.init_backward_hook(self)
        self._forward_hook = impl.init_forward_pre_hook(self)
        self._post_backward_hook = impl.init_post_backward_hook(self)
        self._post_step_hook = impl.init_post_optimizer_step_hook(self)

    def _register_grad_hook(self, name, param, self_ref) -> None:
        def on_grad_ready(*_):
            ddp = self_ref()
            if ddp is not None:
                ddp._on_grad_ready(name, param)

        if hasattr(param, "register_post_accumulate_grad_hook"):  # PyTorch >= 2.1
            self._handles.append(param.register_post_accumulate_grad_hook(on_grad_ready))
        else:
            accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
            self._handles.append(accumulator.register_hook(on_grad_ready))
            self._grad_accumulators.append(accumulator)  # keep the node alive

    def _wrap_step(self, optimizer, self_ref) -> None:
        original = optimizer.step

        def step(*args, **kwargs):
            ddp = self_ref()
            if ddp is not None:
                ddp._begin_phase("optimizer_step")
            result = original(*args, **kwargs)
            if ddp is not None:
                ddp._post_step_hook(optimizer)
                ddp._end_phase("optimizer_step")
            return result

        optimizer.step = step
        self._wrapped_steps.append(optimizer)

    def _on_forward(self, inputs) -> None:
        if not torch.is_grad_enabled() or not self.module.training:
            return
        if self.bagua_algorithm_impl.need_reset():
            self._reset_algorithm_buckets([t.name for b in self.bagua_buckets for t in b.tensors])
            self._forward_hook = self.bagua_algorithm_impl.init_forward_pre_hook(self)
            self._backward_hook = self.bagua_algorithm_impl.init_backward_hook(self)
            self._post_backward_hook = self.bagua_algorithm_impl.init_post_backward_hook(self)
            self._post_step_hook = self.bagua_algorithm_impl.init_post_optimizer_step_hook(self)
        elif self._pending_order is not None:
            order, self._pending_order = self._pending_order, None
            self._reset_algorithm_buckets(order)
        if self.autotuner is not None:
            proposal = self.autotuner.step_begin(self.step_counter + 1)
            if proposal is not None:
                if proposal != self.bucket_bytes:
                    self.bucket_bytes = proposal
                    self._reset_algorithm_buckets([t.name for b in self.bagua_buckets for t in b.tensors])
                self.autotuner.window_starts(self.step_counter + 1)
        self.step_counter += 1
        self._begin_phase("forward")
        self._forward_hook(inputs)

    def _begin_phase(self, phase: str) -> None:
        if self._timeline is not None:
            self._phase_start[phase] = self._timeline.now_us()

    def _end_phase(self, phase: str) -> None:
        if self._timeline is not None and phase in self._phase_start:
            self._timeline.span(phase, "phase", self._phase_start.pop(phase), self._timeline.now_us())

    def _on_grad_ready(self, name, param) -> None:
        if not self._callback_queued:
            self._begin_phase("backward")
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if self.overlap:
            self._backward_hook(name, param)
        else:  # communicate after backward: replay the hooks in ready order then
            self._deferred_grads.append((name, param))

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        deferred, self._deferred_grads = self._deferred_grads, []
        for name, param in deferred:
            self._backward_hook(name, param)
        self._post_backward_hook()
        self._end_phase("backward")
        if not self._profiled:
            self._profiled = True
            self._adopt_profiled_order()

    def mark_unready_tensors(self) -> None:
        """Marks, in bucket order, every tensor not marked this iteration (e.g.
        parameters that took no part in the loss), so every rank runs every
        bucket. A missing gradient is communicated as zeros."""
        for bucket in self.bagua_buckets:
            for tensor in bucket.tensors:
                if tensor.name not in self._marked:
                    tensor.bagua_mark_communication_ready()

    def communication_stats(self) -> dict:
        """Per bucket: tensors, bytes, and per op its executions and seconds
        spent on the communication thread since the buckets were last built."""
        import json

        return json.loads(self._bagua_backend.stats_json())

    def wait_pending_comm_ops(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()
        self._marked.clear()

    # -- teardown ---------------------------------------------------------------
    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for optimizer in self._wrapped_steps:
            if "step" in optimizer.__dict__:
                del optimizer.step
        self._wrapped_steps.clear()
        self._bagua_backend = None


def _device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


def _broadcast_coalesced(tensors, group, src: int = 0) -> None:
    """Broadcasts tensors from ``src``, one message per dtype and device."""
    if group.get_size() == 1:
        return
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), members in by_kind.items():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in members]) if members else None
            broadcast(flat, src, comm=group)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class BaguaModule:
    """What ``with_bagua`` returns: the same module, now also a BaguaModule.

    ``module.bagua_ddp`` is the engine; ``module.without_bagua()`` undoes the
    wrapping (hooks removed, the original class restored), after which the
    module can be wrapped again.
    """

    def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten: bool = True, *,
                   overlap: bool = True, autotune: Optional[bool] = None):
        """Wraps this module for distributed training with ``algorithm``.

        ``do_flatten``: buckets in one contiguous buffer each (fusion).
        ``overlap``: communicate while backward runs (True) or after it.
        ``autotune``: tune the bucket size during training (default:
        BAGUA_AUTOTUNE). See docs/execution_optimizer.md.
        """
        if not is_initialized():
            raise RuntimeError(
                "with_bagua needs bagua's process group: call bagua.torch_api.init_process_group() first")
        if getattr(self, "bagua_ddp", None) is not None:
            raise RuntimeError(
                f"this {type(self).__name__} is already wrapped with_bagua; call "
                "module.without_bagua() before wrapping it again")
        ddp = BaguaDistributedDataParallel(self, optimizers, algorithm, process_group, do_flatten,
                                           overlap=overlap, autotune=autotune)
        self.bagua_ddp = ddp
        original_class = type(self)
        self.__class__ = _bagua_class(original_class)
        self._bagua_original_class = original_class
        return self

    def without_bagua(self):
        ddp = getattr(self, "bagua_ddp", None)
        if ddp is None:
            return self
        ddp.remove()
        self.bagua_ddp = None
        self.__class__ = self._bagua_original_class
        return self

    @property
    def bagua_algorithm(self):
        return self.bagua_ddp.bagua_algorithm if getattr(self, "bagua_ddp", None) else None

    @property
    def bagua_buckets(self):
        return self.bagua_ddp.bagua_buckets


_bagua_classes = {}


def _bagua_class(cls):
    if issubclass(cls, BaguaModule):
        return cls
    if cls not in _bagua_classes:
        _bagua_classes[cls] = type(cls.__name__, (cls, BaguaModule), {"__module__": cls.__module__})
    return _bagua_classes[cls]


torch.nn.Module.with_bagua = BaguaModule.with_bagua
