"""BaguaBucket: tensors communicated together, and the ops applied to them.

The Python face of ``bagua_core.Bucket``. Flattening allocates one buffer per
bucket and makes every tensor a view into it, so each op communicates one
contiguous message; unflattened buckets are packed into a staging buffer by
the runtime instead.
"""

from typing import Callable, List, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, core, tensor_view
from bagua.torch_api.tensor import BaguaTensor


class BaguaBucket:
    def __init__(self, tensors: List[BaguaTensor], name: str, flatten: bool = True,
                 alignment: int = 1):
        if not tensors:
            raise InvalidArgumentError(f"bucket '{name}' has no tensors")
        if alignment < 1:
            raise InvalidArgumentError(f"bucket '{name}': alignment must be >= 1, got {alignment}")
        self.name = name
        self.tensors = list(tensors)
        self.flatten = flatten
        self.alignment = alignment
        currents = [t.current() for t in self.tensors]
        first = currents[0]
        for t, current in zip(self.tensors, currents):
            if current.dtype != first.dtype or current.device != first.device:
                raise InvalidArgumentError(
                    f"bucket '{name}' mixes {self.tensors[0].name} ({first.dtype}, {first.device}) "
                    f"with {t.name} ({current.dtype}, {current.device})")
        self.dtype = first.dtype
        self.device = first.device
        self.flattened: Optional[torch.Tensor] = None
        if flatten:
            total = sum(c.numel() for c in currents)
            padded = -(-total // alignment) * alignment
            self.flattened = torch.zeros(padded, dtype=self.dtype, device=self.device)
            offset = 0
            with torch.no_grad():
                for t, current in zip(self.tensors, currents):
                    view = self.flattened[offset:offset + current.numel()].view_as(current)
                    view.copy_(current)
                    t.bagua_setter_closure(view)
                    t._register(view)
                    offset += current.numel()
        else:
            for t, current in zip(self.tensors, currents):
                t._register(current)
        self.backend_bucket = core.Bucket(
            name, [(t.name, tensor_view(t.bagua_registered_tensor(), f"tensor '{t.name}'"))
                   for t in self.tensors])

    def clear_ops(self) -> "BaguaBucket":
        self.backend_bucket.clear_ops()
        return self

    def append_centralized_synchronous_op(self, hierarchical: bool = False, average: bool = True,
                                          scattergather: bool = False,
                                          compression: Optional[str] = None,
                                          group=None) -> "BaguaBucket":
        """C_FP_S: every rank gets the sum (average=False) or average of the
        bucket over the group. ``hierarchical`` reduces inside each node first
        and communicates among node leaders; ``scattergather`` uses
        reduce-scatter + allgather instead of allreduce."""
        for flag, value in (("hierarchical", hierarchical), ("average", average),
                            ("scattergather", scattergather)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"append_centralized_synchronous_op: {flag} must be a bool, got {value!r}")
        if compression is not None:
            raise InvalidArgumentError(
                f"append_centralized_synchronous_op: compression={compression!r} is not available "
                "in this version; use compression=None")
        group = _group_or_default(group)
        hierarchy = group.get_hierarchical_communicators() if hierarchical else None
        self.backend_bucket.append_centralized_synchronous_op(
            group.get_bucket_communicator(), hierarchy, hierarchical, average, scattergather)
        return self

    def append_python_op(self, python_function: Callable[[str], None], group=None) -> "BaguaBucket":
        """Runs ``python_function(bucket_name)`` on the communication thread in
        this bucket's turn. Exceptions it raises fail the iteration."""
        if not callable(python_function):
            raise InvalidArgumentError("append_python_op: python_function must be callable")
        self.backend_bucket.append_python_op(python_function)
        return self

    def bytes(self) -> int:
        return sum(t.bagua_registered_tensor().numel() for t in self.tensors) * \
            torch.tensor([], dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name}, {len(self.tensors)} tensors, {self.dtype}, flatten={self.flatten})"


def _group_or_default(group):
    from bagua.torch_api.communication import _get_default_group

    return group if group is not None else _get_default_group()
