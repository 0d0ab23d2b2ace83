"""Bagua tensors: torch tensors the runtime communicates.

As in Bagua, ``tensor.ensure_bagua_tensor(name, module_name, getter_closure,
setter_closure)`` makes the tensor itself a bagua tensor and returns it:
importing this module adds the ``bagua_*`` methods below to ``torch.Tensor``
(``is_bagua_tensor``, ``ensure_bagua_tensor``, ``to_bagua_tensor``,
``bagua_getter_closure``, ``bagua_setter_closure``, ``bagua_backend_tensor``,
``bagua_ensure_grad``, ``bagua_mark_communication_ready``,
``bagua_mark_communication_ready_without_synchronization``,
``bagua_set_storage``, ``bagua_registered_tensor``) and the attributes
``bagua_tensor_name``, ``bagua_module_name`` and ``bagua_backend``.

The tensor is a *proxy*: what is communicated is its *effective* tensor, what
the getter closure returns (a parameter's gradient for gradient allreduce,
its weights for decentralized algorithms); the setter closure replaces the
effective tensor (``param.grad = t``). The runtime keeps one *registered*
tensor per bagua tensor, the memory the buckets' ops read and write: a slice
of the bucket's flat buffer when flattened. When the training loop replaced
the effective tensor (``optimizer.zero_grad(set_to_none=True)`` makes
autograd allocate a fresh gradient), marking it ready copies the new data
into the registered memory and points the proxy back at it; when there is
none (a parameter this rank did not use), the registered memory is zeroed
and becomes the effective tensor, so the communicated result reaches the
optimizer on every rank, as with DDP.
"""

from typing import Callable, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, check_tensor, tensor_view

__all__ = ["BaguaTensor"]


class _Runtime:
    """What the runtime attaches to a bagua tensor. A pickled tensor drops it
    (closures and the backend are not picklable, and a loaded tensor is
    registered nowhere); a deep copy keeps the closures, not the registration."""

    __slots__ = ("getter", "setter", "registered", "backend", "adopts")

    def __init__(self, getter=None, setter=None):
        self.getter = getter
        self.setter = setter
        self.registered: Optional[torch.Tensor] = None
        self.backend = None
        self.adopts = False  # a replaced effective tensor becomes the registered one (no copy)

    def __reduce__(self):
        return _Runtime, ()

    def __deepcopy__(self, memo):
        return _Runtime(self.getter, self.setter)


def _runtime(tensor) -> _Runtime:
    runtime = tensor.__dict__.get("_bagua_runtime")
    if runtime is None:
        raise RuntimeError("this tensor is not a bagua tensor: call tensor.ensure_bagua_tensor(...) first")
    return runtime


def _name(tensor) -> str:
    return tensor.__dict__.get("bagua_tensor_name", "?")


class _BaguaTensorType(type):
    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, torch.Tensor) and instance.is_bagua_tensor()


class BaguaTensor(metaclass=_BaguaTensorType):
    """The methods bagua adds to ``torch.Tensor`` (as Bagua's
    ``bagua.torch_api.tensor.BaguaTensor`` does); ``isinstance(t,
    BaguaTensor)`` holds for a torch tensor made a bagua tensor.
    ``BaguaTensor(tensor, name, ...)`` is ``tensor.ensure_bagua_tensor(name, ...)``.
    """

    def __new__(cls, tensor: torch.Tensor, name: Optional[str] = None, module_name: Optional[str] = None,
                getter_closure: Optional[Callable] = None, setter_closure: Optional[Callable] = None):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"a bagua tensor is a torch.Tensor, got {type(tensor).__name__}")
        return tensor.ensure_bagua_tensor(name, module_name, getter_closure, setter_closure)

    # -- Bagua's methods, patched onto torch.Tensor ---------------------------------
    def is_bagua_tensor(self) -> bool:
        """Whether ``ensure_bagua_tensor`` was called on this tensor."""
        return "_bagua_runtime" in self.__dict__

    def ensure_bagua_tensor(self, name: Optional[str] = None, module_name: Optional[str] = None,
                            getter_closure: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                            setter_closure: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None):
        """Makes this tensor a bagua tensor in place and returns it.

        ``getter_closure(proxy)`` returns the effective tensor (default: the
        tensor itself); ``setter_closure(proxy, t)`` replaces it (requires a
        getter). Calling it again (another algorithm, another wrap) replaces
        name, module name and closures.
        """
        if setter_closure is not None and getter_closure is None:
            raise InvalidArgumentError(
                "ensure_bagua_tensor: a setter_closure needs a getter_closure (what it sets is what "
                "the getter returns)")
        for what, closure in (("getter_closure", getter_closure), ("setter_closure", setter_closure)):
            if closure is not None and not callable(closure):
                raise InvalidArgumentError(f"ensure_bagua_tensor: {what} must be callable, got {closure!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidArgumentError(f"ensure_bagua_tensor: name must be a non-empty string, got {name!r}")
        runtime = self.__dict__.get("_bagua_runtime")
        if name is None:  # the runtime names tensors to the backend: keep one
            name = self.__dict__.get("bagua_tensor_name") or f"tensor_{id(self)}"
        self.bagua_tensor_name = name
        self.bagua_module_name = module_name
        if runtime is None:
            self._bagua_runtime = _Runtime(getter_closure, setter_closure)
        else:
            runtime.getter, runtime.setter = getter_closure, setter_closure
        return self

    def to_bagua_tensor(self, name: Optional[str] = None, module_name: Optional[str] = None,
                        getter_closure=None, setter_closure=None):
        """A new bagua tensor sharing this tensor's storage; this one is unchanged."""
        return self.view(self.dtype).ensure_bagua_tensor(name, module_name, getter_closure, setter_closure)

    def bagua_getter_closure(self) -> Optional[torch.Tensor]:
        """The effective tensor: what the runtime communicates."""
        getter = _runtime(self).getter
        return getter(self) if getter is not None else self

    def bagua_setter_closure(self, tensor: torch.Tensor) -> None:
        """Makes ``tensor`` the effective tensor. Without a setter closure the
        effective tensor is pointed at ``tensor``'s memory (``set_``)."""
        setter = _runtime(self).setter
        if setter is not None:
            setter(self, tensor)
            return
        with torch.no_grad():
            self.bagua_getter_closure().set_(tensor)

    def bagua_backend_tensor(self):
        """The runtime's view of this tensor (``bagua_core.TensorView``): of
        the registered memory once in a bucket, else of the effective tensor."""
        runtime = _runtime(self)
        target = runtime.registered if runtime.registered is not None else self._bagua_current()
        return tensor_view(target, f"tensor '{_name(self)}'", allow_cuda=True)

    def bagua_ensure_grad(self):
        """Gives the tensor a zero gradient if it has none; returns the tensor."""
        if self.grad is None:
            with torch.no_grad():
                self.grad = torch.zeros_like(self.data)
        return self

    def bagua_mark_communication_ready(self) -> None:
        """Tells the runtime this tensor's data is final for this iteration
        (CUDA: once the kernels queued so far on the current stream ran)."""
        self._bagua_mark_ready(synchronize=True)

    def bagua_mark_communication_ready_without_synchronization(self) -> None:
        """Marks the tensor ready at once, without ordering after the current
        CUDA stream's kernels."""
        self._bagua_mark_ready(synchronize=False)

    def bagua_set_storage(self, storage, storage_offset: int = 0) -> None:
        """Moves the effective tensor onto ``storage`` (at ``storage_offset``
        elements), through the setter closure when there is one."""
        effective = self.bagua_getter_closure()
        with torch.no_grad():
            # Its own strides: a channels_last tensor stays channels_last.
            if _runtime(self).setter is None:
                effective.set_(storage, storage_offset, effective.shape, effective.stride())
                return
            moved = torch.empty(0, dtype=effective.dtype, device=effective.device)
            moved.set_(storage, storage_offset, effective.shape, effective.stride())
            self.bagua_setter_closure(moved)

    def bagua_registered_tensor(self) -> torch.Tensor:
        """The memory the buckets' ops use for this tensor."""
        registered = _runtime(self).registered
        if registered is None:
            raise RuntimeError(f"tensor '{_name(self)}' is not in a bucket yet")
        return registered

    # -- for the runtime (buckets and the engine) --------------------------------
    def _bagua_current(self) -> torch.Tensor:
        """The effective tensor, checked: the runtime can communicate it."""
        value = self.bagua_getter_closure()
        if value is None:
            raise InvalidArgumentError(f"tensor '{_name(self)}': its getter returned None")
        check_tensor(value, f"tensor '{_name(self)}'", any_dense_order=True)
        return value

    def _bagua_register(self, registered: torch.Tensor, adopts: bool = False) -> None:
        runtime = _runtime(self)
        runtime.registered = registered
        runtime.adopts = adopts

    def _bagua_attach_backend(self, backend) -> None:
        _runtime(self).backend = backend

    def _bagua_sync_registered(self) -> None:
        """Makes the registered memory hold the current data and the effective
        tensor (see the module docstring)."""
        runtime = _runtime(self)
        value = self.bagua_getter_closure()
        registered = self.bagua_registered_tensor()
        if value is None:
            registered.zero_()
            if runtime.setter is not None:  # e.g. the gradient of a parameter unused on this rank
                self.bagua_setter_closure(registered)
            return
        if value.data_ptr() != registered.data_ptr():
            if runtime.adopts and runtime.backend is not None and _adoptable(value, registered):
                # The bucket reads and writes the new tensor itself: no copy,
                # and the effective tensor already is it.
                runtime.backend.rebind_tensor(_name(self), tensor_view(value, f"tensor '{_name(self)}'",
                                                                       any_dense_order=True))
                runtime.registered = value
                return
            with torch.no_grad():
                registered.copy_(value.view_as(registered))
            self.bagua_setter_closure(registered)

    def _bagua_mark_ready(self, synchronize: bool) -> None:
        # Called once per gradient per step: the common case (the effective
        # tensor is the registered view, e.g. a gradient autograd accumulated
        # into its bucket) is one identity check, without the closures'
        # round trips of _bagua_sync_registered.
        runtime = _runtime(self)
        if runtime.backend is None:
            runtime.backend = _named_backend(self)
        if runtime.backend is None:
            raise RuntimeError(
                f"tensor '{_name(self)}' is not registered with a backend (is the module wrapped "
                "with with_bagua?)")
        registered = runtime.registered
        getter = runtime.getter
        if registered is None or (getter(self) if getter is not None else self) is not registered:
            self._bagua_sync_registered()
            registered = self.bagua_registered_tensor()
        if registered.is_cuda and synchronize:
            # The runtime records an event on the producing stream and the
            # communication stream waits on it (on the device): nobody here
            # waits for the kernels.
            stream = torch.cuda.current_stream(registered.device).cuda_stream
            runtime.backend.mark_communication_ready(self.bagua_tensor_name, cuda_stream=stream)
        else:
            runtime.backend.mark_communication_ready(self.bagua_tensor_name)


def _adoptable(value: torch.Tensor, registered: torch.Tensor) -> bool:
    """Whether a bucket may use ``value`` in place of ``registered``: host
    memory of the same dtype, shape and memory order, dense."""
    return (value.device.type == "cpu" and registered.device.type == "cpu" and value.layout == torch.strided
            and value.dtype == registered.dtype and value.shape == registered.shape
            and value.stride() == registered.stride() and not value.requires_grad
            and (value.is_contiguous() or value.is_contiguous(memory_format=torch.channels_last)))


def _named_backend(tensor):
    """Bagua's low-level API: a tensor made with ``module_name`` belongs to
    ``get_backend(module_name)`` (whose ordered buckets the user registers)
    until an engine attaches its own. Only a backend already created by
    ``get_backend`` is found: none is started here."""
    module_name = tensor.__dict__.get("bagua_module_name")
    if module_name is None:
        return None
    from bagua.torch_api import _compat_communication

    return _compat_communication.existing_backend(module_name)


def _bagua_backend(self):
    """The runtime backend of the module this tensor is registered with (None
    when it is not)."""
    runtime = self.__dict__.get("_bagua_runtime")
    if runtime is None:
        return None
    return runtime.backend if runtime.backend is not None else _named_backend(self)


# Patch torch.Tensor, as Bagua does: its scripts and algorithms call these on
# parameters and optimizer state.
for _method in ("is_bagua_tensor", "ensure_bagua_tensor", "to_bagua_tensor", "bagua_getter_closure",
                "bagua_setter_closure", "bagua_backend_tensor", "bagua_ensure_grad",
                "bagua_mark_communication_ready", "bagua_mark_communication_ready_without_synchronization",
                "bagua_set_storage", "bagua_registered_tensor", "_bagua_current", "_bagua_register",
                "_bagua_attach_backend", "_bagua_sync_registered", "_bagua_mark_ready"):
    setattr(torch.Tensor, _method, BaguaTensor.__dict__[_method])
torch.Tensor.bagua_backend = property(_bagua_backend)
del _method
