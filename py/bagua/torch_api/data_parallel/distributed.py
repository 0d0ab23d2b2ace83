"""Bagua's ``bagua.torch_api.data_parallel.DistributedDataParallel``: a
``torch.nn.Module`` wrapper with PyTorch DDP's signature plus Bagua's
``optimizers`` and ``algorithm``, over bagua's engine
(:class:`~bagua.torch_api.data_parallel.bagua_distributed.BaguaDistributedDataParallel`).

    net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt],
                                                      algorithm=GradientAllReduceAlgorithm())

Arguments bagua does not implement (``device_ids``, ``output_device``,
``dim != 0``, ``check_reduction``) make the
function fall back to ``torch.nn.parallel.DistributedDataParallel`` with a
warning, as Bagua does. ``wrapper.inner`` is the engine, with Bagua's
``bagua_build_params()``, ``bagua_module_name``, ``bagua_optimizers``,
``require_backward_grad_sync`` and ``parameters_to_ignore``.
"""

import warnings
import weakref
from contextlib import contextmanager
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.modules import Module
from torch.nn.parallel import DistributedDataParallel as TorchDistributedDataParallel

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.process_group import BaguaProcessGroup, _get_default_group

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0",
           "DistributedDataParallel_V1_9_0_Interface", "to_bagua_process_group"]


def to_bagua_process_group(process_group=None) -> BaguaProcessGroup:
    """The bagua group of ``process_group``: None is the default group, a
    bagua group is itself, a ``torch.distributed`` group is converted with
    :func:`~bagua.torch_api.communication.from_torch_group` (collective)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return _get_default_group()
    if isinstance(process_group, BaguaProcessGroup):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        from bagua.torch_api.communication import from_torch_group

        return from_torch_group(process_group)
    raise InvalidArgumentError(f"unexpect input {type(process_group)}: expected a torch.distributed "
                               "ProcessGroup, a BaguaProcessGroup or None")


def _release_previous_engine(module: Module) -> None:
    """Wrapping a module again switches its algorithm, as in Bagua (its
    test_model_switch): the engine of an earlier wrapper, or of
    ``with_bagua``, is removed first (its hooks and background work), or both
    engines' hooks would fire on every gradient."""
    previous = getattr(module, "_bagua_data_parallel_engine", None)
    engine = previous() if previous is not None else None
    if engine is not None:
        engine.remove()
        module._bagua_data_parallel_engine = None
    if getattr(module, "bagua_ddp", None) is not None and hasattr(module, "without_bagua"):
        module.without_bagua()


class _DistributedDataParallelEngine(BaguaDistributedDataParallel):
    """Bagua's engine with what its DDP wrapper adds: a chosen module name,
    ignored parameters, DDP's ``no_sync`` switch and the record of which
    parameters took part in the last backward (``find_unused_parameters``)."""

    def __init__(self, module: Module, optimizers, algorithm, process_group: BaguaProcessGroup,
                 bagua_module_name: Optional[str] = None, gradient_as_bucket_view: bool = True,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True):
        self._requested_module_name = bagua_module_name
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        #: names of the parameters whose gradients the last backward produced
        self.autograd_graph_params = {}
        #: the parameter names not communicated (``_bagua_params_and_buffers_to_ignore``
        #: and DDP's ``_ddp_params_and_buffers_to_ignore`` on the module)
        self.parameters_to_ignore = list(getattr(module, "_bagua_params_and_buffers_to_ignore", [])) + list(
            getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        self._engine_planning = True
        super().__init__(module, list(optimizers), algorithm, process_group, do_flatten=gradient_as_bucket_view,
                         broadcast_buffers=broadcast_buffers)
        self._engine_planning = False
        self._gate_gradient_hooks()
        ref = weakref.ref(self)
        self._clear_handle = module.register_forward_pre_hook(
            lambda *_: ref() is not None and ref().autograd_graph_params.clear())

    # Bagua's names for what the engine calls otherwise.
    @property
    def bagua_module_name(self) -> str:
        return self._bagua_module_name

    @bagua_module_name.setter
    def bagua_module_name(self, value: str) -> None:
        self._bagua_module_name = self._requested_module_name or value

    @property
    def bagua_optimizers(self) -> List[torch.optim.Optimizer]:
        return self.optimizers

    @property
    def bagua_train_step_counter(self) -> int:
        return self.step_counter

    def bagua_build_params(self):
        """(name, parameter) pairs that require grad, not ignored, shared ones
        once; with ``find_unused_parameters``, after a backward, only those
        that got a gradient in it."""
        params = [(n, p) for n, p in super().bagua_build_params() if n not in self.parameters_to_ignore]
        if self.find_unused_parameters and not self._engine_planning and self.autograd_graph_params:
            params = [(n, p) for n, p in params if n in self.autograd_graph_params]
        return params

    def _reset_algorithm_buckets(self, order=None) -> None:
        # Buckets always hold every parameter: one unused in a backward is
        # communicated as zeros, so ranks never disagree on the buckets.
        self._engine_planning = True
        try:
            super()._reset_algorithm_buckets(order)
        finally:
            self._engine_planning = False

    def _gate_gradient_hooks(self) -> None:
        """Gradients become ready only while synchronizing (outside
        ``no_sync``); each one is recorded for ``find_unused_parameters``."""
        hooks = self._hooks
        if hooks is None:  # a rank outside the process group: no hooks at all
            return
        on_grad_ready = hooks.on_grad_ready
        ref = weakref.ref(self)

        def gated(name, param, *rest):
            engine = ref()
            if engine is None or not engine.require_backward_grad_sync:
                return
            if engine.find_unused_parameters:
                engine.autograd_graph_params[name] = param
            on_grad_ready(name, param, *rest)

        hooks.on_grad_ready = gated

    def remove(self) -> None:
        self._clear_handle.remove()
        super().remove()


class DistributedDataParallel_V1_9_0_Interface(Module):
    """PyTorch 1.9.0 DDP's interface; what bagua does not implement raises
    NotImplementedError."""

    @contextmanager
    def no_sync(self):
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        raise NotImplementedError

    def scatter(self, inputs, kwargs, device_ids):
        raise NotImplementedError

    def to_kwargs(self, inputs, kwargs, device_id):
        raise NotImplementedError

    def gather(self, outputs, output_device):
        raise NotImplementedError

    def train(self, mode: bool = True):
        super().train(mode)
        return self

    @contextmanager
    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        raise NotImplementedError

    def register_comm_hook(self, state: object, hook: Callable):
        raise NotImplementedError

    def will_sync_module_buffers(self):
        raise NotImplementedError


class DistributedDataParallel_V1_9_0(DistributedDataParallel_V1_9_0_Interface):
    """``module`` trained with bagua: the forward is the module's, the
    engine (``self.inner``) communicates during backward as ``algorithm``
    says. Construct it through :func:`DistributedDataParallel`."""

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group=None, bucket_cap_mb: int = 25,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = True, optimizers: Optional[List[torch.optim.Optimizer]] = None,
                 algorithm=None) -> None:
        super().__init__()
        if not any(p.requires_grad for p in module.parameters()):
            raise InvalidArgumentError("DistributedDataParallel is not needed when a module doesn't have any "
                                       "parameter that requires a gradient.")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        device_types = {p.device.type for p in module.parameters()}
        if len(device_types) != 1:
            raise ValueError("DistributedDataParallel's input module must be on the same type of devices, "
                             f"but input module parameters locate in {device_types}.")
        if algorithm is None:  # by name: the algorithms sit above this engine
            from bagua.torch_api.algorithms.base import Algorithm

            algorithm = Algorithm.init("gradient_allreduce")
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        self.device_type = next(iter(device_types))
        self.static_graph = False
        self.dim = dim
        self.module = module
        self.device = next(iter(module.parameters())).device
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        if getattr(module, "_bagua_module_name", None) is None:
            module._bagua_module_name = f"{type(self).__name__}_{id(module)}"
        _release_previous_engine(module)
        self.inner = _DistributedDataParallelEngine(
            module, optimizers or [], algorithm, process_group=to_bagua_process_group(process_group),
            bagua_module_name=module._bagua_module_name, gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers)
        module._bagua_data_parallel_engine = weakref.ref(self.inner)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward synchronizes gradients (False inside :meth:`no_sync`)."""
        return self.inner.require_backward_grad_sync

    @property
    def parameters_to_ignore(self) -> List[str]:
        """Names of the parameters not communicated."""
        return self.inner.parameters_to_ignore

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally; the first
        backward after it synchronizes what was accumulated, as in PyTorch DDP."""
        previous = self.inner.require_backward_grad_sync
        self.inner.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.inner.require_backward_grad_sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """As DDP's ``join()``, over bagua's engine (see ``data_parallel.join``)."""
        from bagua.torch_api.data_parallel.join import join

        return join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    @property
    def bagua_algorithm(self):
        """The algorithm's implementation (reified for the process group)."""
        return self.inner.bagua_algorithm_impl

    @property
    def bagua_optimizers(self) -> List[torch.optim.Optimizer]:
        return self.inner.bagua_optimizers

    @property
    def bagua_buckets(self):
        return self.inner.bagua_buckets


def DistributedDataParallel(module: Module, device_ids: Optional[List[Union[int, torch.device]]] = None,
                            output_device: Union[int, torch.device, None] = None, dim: int = 0,
                            broadcast_buffers: bool = True, process_group=None, bucket_cap_mb: int = 25,
                            find_unused_parameters: bool = False, check_reduction: bool = False,
                            gradient_as_bucket_view: bool = True,
                            optimizers: Optional[List[torch.optim.Optimizer]] = None, algorithm=None,
                            ) -> Union[TorchDistributedDataParallel, DistributedDataParallel_V1_9_0]:
    """PyTorch DDP's interface plus Bagua's ``optimizers`` (the ones that
    step ``module``'s parameters; default none) and ``algorithm`` (default
    :class:`~bagua.torch_api.algorithms.gradient_allreduce.GradientAllReduceAlgorithm`).

    ``gradient_as_bucket_view`` lets gradients live in the buckets' flat
    buffers (bagua's ``do_flatten``). ``find_unused_parameters`` only
    changes what ``inner.bagua_build_params()`` reports after a backward:
    parameters without a gradient are always communicated as zeros.
    ``bucket_cap_mb`` is not used (BAGUA_DEFAULT_BUCKET_SIZE sets the bucket
    size). ``broadcast_buffers`` as DDP's: rank 0's buffers broadcast before
    each training forward (for algorithms whose ranks share weights; see
    ``data_parallel.buffers``). With ``device_ids``, ``output_device``,
    ``dim != 0`` or ``check_reduction``, this returns
    ``torch.nn.parallel.DistributedDataParallel`` instead, with a warning.
    """
    supported = [device_ids is None, output_device is None, dim == 0, check_reduction is False]
    if not all(supported):
        warnings.warn("Some parameters passed into BaguaDistributedDataParallel have not been supported yet. "
                      "Bagua has automatically fallback to upstream PyTorch DistributedDataParallel "
                      "implementation.")
        return TorchDistributedDataParallel(
            module=module, device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view)
    return DistributedDataParallel_V1_9_0(
        module=module, device_ids=device_ids, output_device=output_device, dim=dim,
        broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
        gradient_as_bucket_view=gradient_as_bucket_view, optimizers=optimizers, algorithm=algorithm)
