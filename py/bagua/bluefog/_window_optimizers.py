"""BlueFog's window optimizers: asynchronous neighbour averaging through
one-sided window operations (win_put, win_get, win_accumulate), one window
per parameter. The public constructors are in optimizers.py."""

from typing import Dict

import torch

from bagua.bluefog import _collectives, _state, _windows
from bagua.bluefog._optimizer_base import _Distributed


class _WindowOptimizer(_Distributed):
    """What the window optimizers share: one window per parameter in
    ``self._windows``; ``step()`` (after a barrier with ``force_barrier``)
    waits for the window ops in flight and applies them, then updates
    locally."""

    def step(self, closure=None):
        if self.force_barrier:
            _collectives.barrier()
        communicating = self._communicating()
        if not self._skip_synchronize:
            self.synchronize()
        if communicating:
            self._reset_passes()
        return self._base.step(self, closure)

    def unregister_window(self):
        """Frees the optimizer's windows (collective)."""
        self.synchronize()
        for name in self._windows.values():
            if name in _windows.get_current_created_window_names():
                _windows.win_free(name)
        self._windows.clear()


class _WinPut(_WindowOptimizer):
    """Asynchronous: one window per parameter; the forward pass that
    completes a communication puts the parameter to the out-neighbours
    (``dst_weights``, default all with weight 1), and ``step()`` waits for
    the puts and sets the parameter to the average of itself and the latest
    values its in-neighbours put (``win_update``), then updates locally.
    With ``_pull`` (pull-get) the forward pass gets the in-neighbours'
    parameters instead (``src_weights``, their mutexes held)."""

    _pull = False

    def __init__(self, optimizer, model, num_steps_per_communication, window_prefix):
        super().__init__(optimizer, model, num_steps_per_communication)
        self.dst_weights = None
        self.src_weights = None
        self.force_barrier = False
        self._prefix = f"{window_prefix}." if window_prefix is not None else ""
        self._windows: Dict[torch.nn.Parameter, str] = {}
        if _state.size() > 1:
            for p in self._parameters():
                name = self._prefix + self._names[p]
                if not _windows.win_create(p.data, name):
                    raise ValueError(f"DistributedWinPutOptimizer: window {name!r} exists already; "
                                     "pass another window_prefix")
                self._windows[p] = name

    def _on_pass(self):
        if self._passes != self._steps_per_communication:
            return
        for p, name in self._windows.items():
            if self._pull:
                self._handles[p] = _windows.win_get_nonblocking(
                    name, src_weights=self.src_weights, require_mutex=True)
            else:
                self._handles[p] = _windows.win_put_nonblocking(p.data, name,
                                                                dst_weights=self.dst_weights)

    def synchronize(self):
        with torch.no_grad():
            for p, handle in list(self._handles.items()):
                _windows.win_wait(handle)
                _windows.win_update(self._windows[p], require_mutex=True)  # into p itself
        self._handles.clear()


class _PullGet(_WinPut):
    _pull = True


class _PushSum(_WindowOptimizer):
    """Push-sum (gradient push): per parameter a window holding the
    numerator z = x * w and the push-sum weight w as its last element (zero
    buffers). The forward pass that completes a communication accumulates
    (z, w) / (d + 1) into each out-neighbour and keeps its own share
    (``self_weight``, ``dst_weights`` knobs, mutex held); ``step()`` collects
    what arrived and sets the parameter to z / w, then updates locally. The
    sum of (z, w) over ranks is conserved, so x = z / w reaches the average
    even on a directed graph."""

    def __init__(self, optimizer, model, num_steps_per_communication):
        super().__init__(optimizer, model, num_steps_per_communication)
        outs = _state.out_neighbor_ranks()
        self.self_weight = 1.0 / (len(outs) + 1)
        self.dst_weights = {r: 1.0 / (len(outs) + 1) for r in outs}
        self.force_barrier = True
        self._windows: Dict[torch.nn.Parameter, str] = {}
        self._extended: Dict[torch.nn.Parameter, torch.Tensor] = {}
        if _state.size() > 1:
            for p in self._parameters():
                name = "push_sum." + self._names[p]
                ext = torch.cat([p.data.reshape(-1), torch.ones(1, dtype=p.dtype)]).contiguous()
                if not _windows.win_create(ext, name, zero_init=True):
                    raise ValueError(f"DistributedPushSumOptimizer: window {name!r} exists already")
                self._windows[p], self._extended[p] = name, ext

    def _on_pass(self):
        if self._passes != self._steps_per_communication:
            return
        with torch.no_grad():
            for p, name in self._windows.items():
                ext = self._extended[p]
                ext[:-1].copy_(p.data.reshape(-1) * ext[-1])  # z = x * w after the local steps
                self._handles[p] = _windows.win_accumulate_nonblocking(
                    ext, name, self_weight=self.self_weight, dst_weights=self.dst_weights,
                    require_mutex=True)

    def synchronize(self):
        with torch.no_grad():
            for p, handle in list(self._handles.items()):
                _windows.win_wait(handle)
                ext = _windows.win_update_then_collect(self._windows[p])
                p.data.copy_((ext[:-1] / ext[-1]).reshape(p.shape))
        self._handles.clear()
