"""Working under ``torch.compile``, as DDP does.

Two things make a wrapped module compile and still overlap communication
with the backward pass:

- The module's forward hooks run eagerly (:func:`eager`). Dynamo would
  otherwise trace into them and fail on what it cannot fake (the engine's
  tensors, its C++ backend); marked as not traceable, each hook is a graph
  break: it runs as plain Python between compiled graphs.
- While a training forward runs, Dynamo is told, as DDP tells it, that a
  data-parallel module is active (:class:`GraphSplitHint`). Dynamo then
  compiles the forward as several graphs cut at about one bucket's worth of
  parameters (its ``DDPOptimizer``), so the backward produces the last
  layers' gradients first and their buckets communicate while the earlier
  layers' backward still runs. Without the cut the whole backward is one
  graph, and every gradient becomes ready at its end.

Dynamo reads the active module through
``DistributedDataParallel._active_ddp_module``, a class attribute that DDP
and ``torch.distributed._composable.replicate`` set around their forward;
Dynamo uses only its ``bucket_bytes_cap``. On PyTorch without Dynamo (1.x)
both are no-ops.
"""

from typing import Callable

try:  # PyTorch >= 2.0
    import torch._dynamo as _dynamo
    from torch.nn.parallel import DistributedDataParallel as _TorchDDP
except ImportError:  # pragma: no cover - PyTorch 1.x
    _dynamo = None
    _TorchDDP = None

__all__ = ["eager", "GraphSplitHint"]


def eager(fn: Callable) -> Callable:
    """``fn``, run eagerly when called from code that torch.compile traces."""
    if _dynamo is None:
        return fn
    return _dynamo.disable(fn, recursive=True)


class _ActiveModule:
    """What Dynamo reads of an active data-parallel module."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes_cap = bucket_bytes


class GraphSplitHint:
    """Marks one module's training forwards as data-parallel for Dynamo.

    ``enter`` before the forward, ``leave`` after it (or at the end of
    backward, if the forward raised); nesting restores what was there
    before, as DDP's own ``_inside_ddp_forward`` does.
    """

    def __init__(self, bucket_bytes: int):
        self._active = _ActiveModule(bucket_bytes)
        self._previous = None
        self._entered = False

    @property
    def bucket_bytes(self) -> int:
        return self._active.bucket_bytes_cap

    @bucket_bytes.setter
    def bucket_bytes(self, value: int) -> None:
        self._active.bucket_bytes_cap = int(value)

    def enter(self) -> None:
        if _TorchDDP is None or self._entered or not hasattr(_TorchDDP, "_active_ddp_module"):
            return
        self._previous = _TorchDDP._active_ddp_module
        _TorchDDP._active_ddp_module = self._active
        self._entered = True

    def leave(self) -> None:
        if not self._entered:
            return
        if _TorchDDP._active_ddp_module is self._active:
            _TorchDDP._active_ddp_module = self._previous
        self._previous = None
        self._entered = False

