"""BlueFog's distributed optimizers: adapt-with-combine (AWC),
adapt-then-combine (ATC) and gradient allreduce.

Each wraps a torch optimizer and returns an instance of a subclass of the
wrapped optimizer's class, as BlueFog does, so ``isinstance(opt, Adam)`` still
holds. With W the combination of the communication type (neighbour average,
hierarchical neighbour average, global average, or none):

- AWC: x_{k+1} = W x_k - lr g(x_k). The combination of x_k starts at the
  forward pass (on BlueFog's worker thread, overlapping forward and
  backward) and is applied in ``step()`` before the local update.
- ATC: x_{k+1} = W (x_k - lr g(x_k)): the local update, then the
  combination, both in ``step()`` (BlueFog overlaps per parameter during
  backward; here the combination follows the whole update).
- Gradient allreduce: the gradients are averaged over all ranks before the
  update, in buckets of up to ``BLUEFOG_FUSION_THRESHOLD`` bytes allreduced
  during backward as they fill, and ``step()`` waits for them.

``num_steps_per_communication`` = J: J training forward passes (in training
mode, with gradients enabled; a module called twice in one pass counts once)
make one communication, in the next ``step()``; a step before that is a local
update. The knobs ``self_weight``, ``src_weights``, ``dst_weights``,
``src_machine_weights``, ``dst_machine_weights``, ``enable_topo_check``
(False by default) and ``communication_type`` are read at each
communication, so they can change every iteration (dynamic topologies).
"""

import warnings
from enum import Enum
from typing import List, Union

import torch

from bagua.bluefog import _collectives, _hierarchical, _ops, _state
from bagua.bluefog._optimizer_base import _Distributed, _wrap
from bagua.bluefog._window_optimizers import _PullGet, _PushSum, _WinPut

__all__ = ["CommunicationType", "DistributedAdaptWithCombineOptimizer",
           "DistributedAdaptThenCombineOptimizer", "DistributedGradientAllreduceOptimizer",
           "DistributedWinPutOptimizer", "DistributedPullGetOptimizer",
           "DistributedPushSumOptimizer",
           "DistributedAllreduceOptimizer", "DistributedNeighborAllreduceOptimizer",
           "DistributedHierarchicalNeighborAllreduceOptimizer"]


class CommunicationType(Enum):
    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


class _Combine(_Distributed):
    """AWC (``_atc`` False) and ATC (True)."""

    _atc = False

    def __init__(self, optimizer, model, communication_type, num_steps_per_communication):
        super().__init__(optimizer, model, num_steps_per_communication)
        if not isinstance(communication_type, CommunicationType):
            raise ValueError(f"communication_type must be a CommunicationType, got "
                             f"{communication_type!r}")
        self.communication_type = communication_type
        self.self_weight = None
        self.src_weights = None
        self.dst_weights = None
        self.src_machine_weights = None
        self.dst_machine_weights = None
        self.enable_topo_check = False

    def _on_pass(self):
        # AWC combines x_k, the point this pass computes the gradient at.
        if not self._atc and self._passes == self._steps_per_communication:
            self._start()

    def _start(self):
        for p in self._parameters():
            handle = self._start_one(p, self._names[p])
            if handle is not None:
                self._handles[p] = handle

    def _start_one(self, p, name):
        kind = self.communication_type
        if kind == CommunicationType.empty:
            return None
        if kind == CommunicationType.allreduce:
            return _collectives.allreduce_nonblocking(p.data, average=True, name=name)
        if kind == CommunicationType.neighbor_allreduce:
            return _ops.neighbor_allreduce_nonblocking(
                p.data, self_weight=self.self_weight, src_weights=self.src_weights,
                dst_weights=self.dst_weights, enable_topo_check=self.enable_topo_check, name=name)
        return _hierarchical.hierarchical_neighbor_allreduce_nonblocking(
            p.data, self_weight=self.self_weight, src_machine_weights=self.src_machine_weights,
            dst_machine_weights=self.dst_machine_weights,
            enable_topo_check=self.enable_topo_check, name=name)

    def step(self, closure=None):
        communicating = self._communicating()
        if not self._atc:
            if not self._skip_synchronize:
                self.synchronize()
            loss = self._base.step(self, closure)
        else:
            loss = self._base.step(self, closure)
            if communicating:
                self._start()
                if not self._skip_synchronize:
                    self.synchronize()
        if communicating:
            self._reset_passes()
        return loss


class _Atc(_Combine):
    _atc = True


class _GradientAllreduce(_Distributed):
    """The gradients averaged over all ranks, in buckets: as backward
    accumulates each gradient (a hook on the parameter's gradient
    accumulator, as in BlueFog and Horovod) it joins the open bucket, and a
    bucket reaching ``BLUEFOG_FUSION_THRESHOLD`` bytes is allreduced at once
    as one flat buffer, overlapping the rest of backward; ``step()`` sends the
    last bucket, waits for all, then updates. Every rank's autograd runs the
    hooks in the same order, so the ranks build the same buckets and issue
    them in the same order. A threshold of 0: one allreduce per gradient."""

    def __init__(self, optimizer, model, num_steps_per_communication):
        super().__init__(optimizer, model, num_steps_per_communication)
        self._accumulators = []  # keeps the grad_fn nodes (and their hooks) alive
        self._gradient_hooks = []
        for p in self._parameters():
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            self._gradient_hooks.append(accumulator.register_hook(self._gradient_ready(p)))
            self._accumulators.append(accumulator)
        self._open, self._open_bytes = [], 0  # gradients ready, not yet sent
        self._sent = set()  # gradients of this communication already in a bucket
        self._synchronized = False  # this communication's buckets all sent and written
        self._buckets = []  # (parameters, handle) in flight

    def unregister_hooks(self):
        super().unregister_hooks()
        for hook in self._gradient_hooks:
            hook.remove()
        self._gradient_hooks = []

    def _gradient_ready(self, p):
        def hook(*_):
            if (self._communicating() and not self._synchronized and p.grad is not None
                    and p not in self._sent):
                self._add(p)
                if self._open_bytes >= _state.state().worker.threshold:
                    self._send_open()
        return hook

    def _add(self, p):
        self._sent.add(p)
        self._open.append(p)
        self._open_bytes += p.grad.numel() * p.grad.element_size()

    def _send_open(self):
        """Allreduces the open bucket: one flat buffer per dtype and device."""
        groups = {}
        for p in self._open:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for params in groups.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            name = f"gradients {self._names[params[0]]}..{self._names[params[-1]]}"
            self._buckets.append((params, _collectives.allreduce_nonblocking(flat, average=True,
                                                                             name=name)))
        self._open, self._open_bytes = [], 0

    def _flush(self):
        """Sends the open bucket, with the gradients backward did not reach
        (no hook ran for them)."""
        for p in self._parameters():
            if p.grad is not None and p not in self._sent:
                self._add(p)
        if self._open:
            self._send_open()

    def synchronize(self):
        """Sends what is left of this communication's gradients, waits for
        every bucket and writes the averages into the gradients (call it
        before clipping them, then ``step()`` under ``skip_synchronize()``)."""
        if self._communicating() and not self._synchronized:
            self._flush()
            self._synchronized = True
        for params, handle in self._buckets:
            flat = _ops.synchronize(handle)
            for p, piece in zip(params, torch.split(flat, [p.grad.numel() for p in params])):
                p.grad.copy_(piece.view_as(p.grad))
        self._buckets = []

    def step(self, closure=None):
        if self._communicating():
            if not self._skip_synchronize:
                self.synchronize()
            self._reset_passes()
            self._sent, self._synchronized = set(), False
        return self._base.step(self, closure)


def DistributedAdaptWithCombineOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
        num_steps_per_communication: int = 1):
    """x_{k+1} = W x_k - lr g(x_k) (see the module's docstring)."""
    return _wrap(_Combine, optimizer, model, communication_type, num_steps_per_communication)


def DistributedAdaptThenCombineOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
        num_steps_per_communication: int = 1):
    """x_{k+1} = W (x_k - lr g(x_k))."""
    return _wrap(_Atc, optimizer, model, communication_type, num_steps_per_communication)


def DistributedGradientAllreduceOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_steps_per_communication: int = 1):
    """The gradients averaged over all ranks before each update."""
    return _wrap(_GradientAllreduce, optimizer, model, num_steps_per_communication)


def DistributedWinPutOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_steps_per_communication: int = 1, window_prefix: str = None):
    """Asynchronous neighbour averaging through one-sided puts (one window
    per parameter, named ``window_prefix.name``); knobs ``dst_weights``
    and ``force_barrier``; ``unregister_window()`` frees the windows."""
    return _wrap(_WinPut, optimizer, model, num_steps_per_communication, window_prefix)


def DistributedPullGetOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_steps_per_communication: int = 1, window_prefix: str = None):
    """As DistributedWinPutOptimizer, pulling: the forward pass gets the
    in-neighbours' parameters (knob ``src_weights``; unexported in
    BlueFog)."""
    return _wrap(_PullGet, optimizer, model, num_steps_per_communication, window_prefix)


def DistributedPushSumOptimizer(
        optimizer: torch.optim.Optimizer, model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_steps_per_communication: int = 1):
    """Push-sum through win_accumulate (exported here; unexported in
    BlueFog, issue #112); knobs ``self_weight``, ``dst_weights``,
    ``force_barrier`` (True by default, as BlueFog)."""
    return _wrap(_PushSum, optimizer, model, num_steps_per_communication)


def _deprecated(old: str, kind: CommunicationType):
    def make(optimizer, model, num_steps_per_communication: int = 1):
        warnings.warn(f"{old} is deprecated; use DistributedAdaptWithCombineOptimizer with "
                      f"communication_type=CommunicationType.{kind.name}",
                      PendingDeprecationWarning, stacklevel=2)
        return DistributedAdaptWithCombineOptimizer(optimizer, model, kind,
                                                    num_steps_per_communication)
    make.__name__ = make.__qualname__ = old
    make.__doc__ = f"Deprecated: AWC with CommunicationType.{kind.name}."
    return make


# BlueFog's older names, AWC with a fixed communication type.
DistributedAllreduceOptimizer = _deprecated("DistributedAllreduceOptimizer",
                                            CommunicationType.allreduce)
DistributedNeighborAllreduceOptimizer = _deprecated("DistributedNeighborAllreduceOptimizer",
                                                    CommunicationType.neighbor_allreduce)
DistributedHierarchicalNeighborAllreduceOptimizer = _deprecated(
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    CommunicationType.hierarchical_neighbor_allreduce)
