"""What BlueFog's wrapped optimizers (optimizers.py, _window_optimizers.py)
share: the wrapping of a torch optimizer into a subclass of its own class,
construction over its parameter groups, parameter names, and the counting
of training forward passes that times each communication."""

import contextlib
import warnings
from typing import Dict, List

import torch

from bagua.bluefog import _ops


_TOO_MANY_PASSES = (
    "Unexpected behavior: more than num_steps_per_communication={} forward computations "
    "y = model(x) ran before an optimizer step() function was called; adjust "
    "num_steps_per_communication to update the parameters locally in between.")


def _modules(model) -> List[torch.nn.Module]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    for m in models:
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or a list of them, got "
                             f"{type(m).__name__}")
    return models


def _parameter_names(optimizer, models) -> Dict[torch.nn.Parameter, str]:
    """Each optimized parameter's name in the model(s) (unique, used as the
    name of its communication)."""
    names, seen = {}, set()
    for i, m in enumerate(models):
        for name, p in m.named_parameters():
            full = f"{i}.{name}" if len(models) > 1 else name
            if full in seen:
                raise ValueError(f"parameter name {full} is not unique")
            seen.add(full)
            names[p] = full
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in names:
                raise ValueError("the optimizer holds a parameter that is not in the model")
    return names


class _Distributed:
    """The part every wrapped optimizer shares: construction over the
    wrapped optimizer's groups, parameter names, and pass counting."""

    _base = torch.optim.Optimizer  # the wrapped class, set per subclass

    def __init__(self, optimizer, model, num_steps_per_communication: int):
        try:
            self._base.__init__(self, optimizer.param_groups, **optimizer.defaults)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            self._base.__init__(self, optimizer.param_groups)
        self.state.update(optimizer.state)
        if isinstance(num_steps_per_communication, bool) or \
                not isinstance(num_steps_per_communication, int) or num_steps_per_communication < 1:
            raise ValueError(f"num_steps_per_communication must be a positive integer, got "
                             f"{num_steps_per_communication!r}")
        self._steps_per_communication = num_steps_per_communication
        self._models = _modules(model)
        self._names = _parameter_names(self, self._models)
        # Training forward passes per model since the last communication; a
        # pass of the whole (one call of each model) counts once.
        self._model_passes = [0] * len(self._models)
        self._passes = 0
        self._handles = {}
        self._hooks = [m.register_forward_pre_hook(self._counter(i))
                       for i, m in enumerate(self._models)]

    def _parameters(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p

    def _counter(self, index: int):
        def before_forward(module, inputs):
            if not (module.training and torch.is_grad_enabled()):
                return
            self._model_passes[index] += 1
            if self._model_passes[index] <= self._passes:
                return  # another model of a pass already counted
            self._passes = self._model_passes[index]
            if self._passes > self._steps_per_communication:
                warnings.warn(_TOO_MANY_PASSES.format(self._steps_per_communication))
            self._on_pass()
        return before_forward

    def _reset_passes(self):
        self._passes = 0
        self._model_passes = [0] * len(self._models)

    def _on_pass(self):
        """Called at each counted forward pass."""

    def _communicating(self) -> bool:
        return self._passes >= self._steps_per_communication

    def synchronize(self):
        """Waits for the communication in flight and writes its results."""
        for p, handle in list(self._handles.items()):
            self._apply(p, _ops.synchronize(handle))
        self._handles.clear()

    def _apply(self, p, result):
        p.data.copy_(result)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, step() does not synchronize (the caller already did)."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    _skip_synchronize = False

    def unregister_hooks(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _wrap(mixin, optimizer, *args):
    """An instance of a subclass of both ``mixin`` and the optimizer's class."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expected a torch optimizer, got {type(optimizer).__name__}")
    base = type(optimizer)
    cls = type(base.__name__, (mixin, base), {"_base": base})
    return cls(optimizer, *args)
