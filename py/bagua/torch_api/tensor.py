"""BaguaTensor: a tensor the runtime communicates, named, with closures that
say where its data lives.

An algorithm decides *what* to communicate for each parameter: its gradient
(gradient allreduce) or its weight (decentralized). The getter closure returns
that tensor, the setter closure replaces it (``param.grad = t``). The runtime
keeps one *registered* tensor per BaguaTensor, the memory the buckets' ops
read and write: a slice of the bucket's flat buffer when flattened. When the
training loop replaced the tensor (``optimizer.zero_grad(set_to_none=True)``
makes autograd allocate a fresh gradient), marking it ready copies the new
data into the registered memory and points the parameter back at it.
"""

from typing import Callable, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, check_tensor


class BaguaTensor:
    def __init__(self, tensor: torch.Tensor, name: str, module_name: Optional[str] = None,
                 getter_closure: Optional[Callable] = None,
                 setter_closure: Optional[Callable] = None):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a BaguaTensor needs a non-empty name, got {name!r}")
        self.bagua_tensor_name = name
        self.bagua_module_name = module_name
        self.tensor = tensor
        self._getter = getter_closure or (lambda t: t)
        self._setter = setter_closure or (lambda t, value: t.data.set_(value.data))
        self._registered: Optional[torch.Tensor] = None
        self._backend = None

    # -- what is communicated ---------------------------------------------
    def bagua_getter_closure(self) -> Optional[torch.Tensor]:
        return self._getter(self.tensor)

    def bagua_setter_closure(self, value: torch.Tensor) -> None:
        self._setter(self.tensor, value)

    def bagua_ensure_grad(self) -> "BaguaTensor":
        _ensure_grad(self.tensor)
        return self

    @property
    def name(self) -> str:
        return self.bagua_tensor_name

    def current(self) -> torch.Tensor:
        value = self.bagua_getter_closure()
        if value is None:
            raise InvalidArgumentError(f"tensor '{self.name}': its getter returned None")
        check_tensor(value, f"tensor '{self.name}'")
        return value

    # -- registration with a bucket ---------------------------------------
    def bagua_registered_tensor(self) -> torch.Tensor:
        if self._registered is None:
            raise RuntimeError(f"tensor '{self.name}' is not in a bucket yet")
        return self._registered

    def _register(self, registered: torch.Tensor) -> None:
        self._registered = registered

    def _attach_backend(self, backend) -> None:
        self._backend = backend

    def _sync_registered(self) -> None:
        """Makes the registered memory hold the current data."""
        value = self.bagua_getter_closure()
        registered = self.bagua_registered_tensor()
        if value is None:
            registered.zero_()
            return
        if value.data_ptr() != registered.data_ptr():
            with torch.no_grad():
                registered.copy_(value.view_as(registered))
            self.bagua_setter_closure(registered)

    def bagua_mark_communication_ready(self) -> None:
        """Tells the runtime this tensor's data is final for this iteration."""
        if self._backend is None:
            raise RuntimeError(
                f"tensor '{self.name}' is not registered with a backend (is the module wrapped "
                "with with_bagua?)")
        self._sync_registered()
        registered = self.bagua_registered_tensor()
        if registered.is_cuda:
            # The runtime records an event on the producing stream and the
            # communication stream waits on it (on the device): nobody here
            # waits for the kernels.
            stream = torch.cuda.current_stream(registered.device).cuda_stream
            self._backend.mark_communication_ready(self.name, cuda_stream=stream)
        else:
            self._backend.mark_communication_ready(self.name)

    def __repr__(self) -> str:
        return f"BaguaTensor({self.name}, {self.tensor.dtype}{list(self.tensor.shape)})"


def _ensure_grad(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.grad is None:
        tensor.grad = torch.zeros_like(tensor)
    return tensor


def _tensor_ensure_bagua_tensor(self, name: Optional[str] = None, module_name: Optional[str] = None,
                                getter_closure=None, setter_closure=None) -> BaguaTensor:
    """Bagua's ``Tensor.ensure_bagua_tensor``: the BaguaTensor of this tensor,
    created on first call and remembered on the tensor."""
    existing = getattr(self, "_bagua_tensor", None)
    if existing is not None and existing.bagua_tensor_name == name:
        existing._getter = getter_closure or existing._getter
        existing._setter = setter_closure or existing._setter
        return existing
    created = BaguaTensor(self, name or f"tensor_{id(self)}", module_name, getter_closure, setter_closure)
    self._bagua_tensor = created
    return created


def _tensor_mark_ready(self) -> None:
    bagua_tensor = getattr(self, "_bagua_tensor", None)
    if bagua_tensor is None:
        raise RuntimeError("this tensor is not a bagua tensor: call ensure_bagua_tensor first")
    bagua_tensor.bagua_mark_communication_ready()


# Bagua's algorithms call these on parameters; keep them working.
torch.Tensor.ensure_bagua_tensor = _tensor_ensure_bagua_tensor
torch.Tensor.bagua_ensure_grad = _ensure_grad
torch.Tensor.bagua_mark_communication_ready = _tensor_mark_ready
