"""Bagua's fused optimizer: one parameter update over many parameters at once.

``fuse_optimizer(optimizer)`` lays each param group's parameters, their
gradients and their optimizer state tensors out back to back in memory
(``do_flatten=True``), and gives the optimizer a ``fuse_step()``. Each
``fuse_step`` finds the runs of parameters that lie contiguously in all of
those at once (``calculate_mutual_groups``), lets the optimizer update each
run as one tensor (a view over the run), and leaves the others as they are.
The result equals ``step()`` element for element: the update is element-wise
and the same formula runs on the same values.

What stays per parameter: ``optimizer.state`` and ``param_groups`` are the
user's as before (the fused views exist only during ``fuse_step``), so
``state_dict()``, checkpoints and LR schedulers see no difference. A
parameter fuses only while its gradient exists. ``zero_grad(set_to_none=True)``
(PyTorch 2's default) lets autograd allocate new gradients that lie apart;
where the weights and the state of a run still lie back to back,
``fuse_step`` first gathers the run's gradients into one buffer (one copy)
and points them at it, so the step still fuses. Under ``with_bagua`` the
runtime owns where gradients live, and they are left where they are.

As in Bagua, ``optimizer._bagua_fused_count`` counts the param groups
updated fused: each ``fuse_step`` adds one per group in which at least one
run of two or more parameters was updated as one tensor (0 when nothing
lay contiguously, e.g. when ``with_bagua`` flattened the weights in its
own bucket order). An optimizer is fused once (:func:`is_fused_optimizer`);
fusing it again is an error.
"""

import types
from typing import Dict, List, Sequence, Tuple

import torch

from bagua.torch_api import InvalidArgumentError

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "calculate_mutual_groups",
           "group_continuous_tensors", "FusedOptimizer"]


# -- layout ---------------------------------------------------------------------------
def _is_next(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``second``'s memory starts where ``first``'s ends."""
    return first.data_ptr() + first.numel() * first.element_size() == second.data_ptr()


def group_continuous_tensors(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """Indices of ``tensors`` in runs that lie back to back in memory (runs
    of two or more), each run in memory order."""
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs, current = [], []
    for i in order:
        if current and not (tensors[i].dtype == tensors[current[-1]].dtype and
                            tensors[i].device == tensors[current[-1]].device and
                            _is_next(tensors[current[-1]], tensors[i])):
            if len(current) > 1:
                runs.append(current)
            current = []
        current.append(i)
    if len(current) > 1:
        runs.append(current)
    return runs


def calculate_mutual_groups(tensors_list: Sequence[Sequence[torch.Tensor]]) -> List[List[int]]:
    """The runs of indices that are contiguous, in the same order, in every
    list of ``tensors_list`` (lists of equal length: e.g. the weights, the
    gradients and each state tensor of the same parameters)."""
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    if any(len(tensors) != size for tensors in tensors_list):
        raise InvalidArgumentError("calculate_mutual_groups: the tensor lists must have equal lengths, got "
                                   f"{[len(t) for t in tensors_list]}")
    groups = group_continuous_tensors(tensors_list[0])
    for tensors in tensors_list[1:]:
        other = group_continuous_tensors(tensors)
        groups = [g for g in groups if g in other]
    return groups


def _storage(t: torch.Tensor):
    """The tensor's storage (untyped where PyTorch has it: typed storage is
    deprecated in 2.x); set_ takes offsets in elements either way."""
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def _flatten_into_one(tensors: List[torch.Tensor]) -> None:
    """Moves ``tensors`` (one dtype and device) into one new buffer, back to
    back in this order, keeping their values; each becomes a view of it."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.set_(_storage(flat), offset, t.shape)
            offset += t.numel()


# -- state ----------------------------------------------------------------------------
def _state_signature(state: dict) -> Tuple:
    """What must be equal for parameters to share one update: the names of
    their state, and the values of their scalars (a step count, a 0-dim
    tensor or a number)."""
    items = []
    for name in sorted(state, key=str):
        value = state[name]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            items.append((name, "tensor", value.dtype))
        elif isinstance(value, torch.Tensor):
            items.append((name, "scalar", value.item()))
        else:
            items.append((name, "value", value))
    return tuple(items)


def _state_tensor_names(state: dict) -> List[str]:
    return [n for n, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]


# -- the API ----------------------------------------------------------------------------
def fuse_optimizer(optimizer: torch.optim.Optimizer, do_flatten: bool = True,
                   check_flatten: bool = True) -> torch.optim.Optimizer:
    """Makes ``optimizer`` able to update many parameters at once: returns
    the same optimizer with a ``fuse_step(closure=None)`` method, to call
    instead of ``step()``.

    ``do_flatten=True`` moves each param group's parameters (per dtype and
    device), their gradients (created as zeros where missing) and each of
    their optimizer state tensors into one buffer each, in the group's order.
    Parameters already wrapped by ``model.with_bagua`` keep their weights and
    gradients where the runtime put them (its buckets hold views of them);
    only their state is flattened. ``check_flatten`` is accepted for Bagua's
    signature. Fusing an optimizer twice is a RuntimeError, as in Bagua."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"fuse_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_fused_optimizer(optimizer):
        # A second flatten would move the tensors the first one laid out.
        raise RuntimeError(f"trying to fuse an optimizer twice: this {type(optimizer).__name__} was already "
                           "passed to fuse_optimizer")
    if do_flatten:
        _flatten_param_groups(optimizer)
    optimizer.fuse_step = types.MethodType(fuse_step, optimizer)
    optimizer._bagua_fused_runs = []  # per fuse_step: how many parameters went into fused runs
    optimizer._bagua_fused_count = 0  # Bagua's: param groups updated fused, over all fuse_steps
    return optimizer


def is_fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` went through :func:`fuse_optimizer`."""
    return hasattr(optimizer, "_bagua_fused_runs")


def _flatten_param_groups(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        kinds: Dict[tuple, List[torch.Tensor]] = {}
        for p in group["params"]:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        for params in kinds.values():
            if len(params) < 2:
                continue
            # Under with_bagua the runtime owns where weights and gradients
            # live (its buckets hold views of them): leave those in place.
            if not any("_bagua_runtime" in p.__dict__ for p in params):
                _flatten_into_one(params)
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                _flatten_into_one([p.grad for p in params])
            states = [optimizer.state.get(p, {}) for p in params]
            if states[0] and all(_state_signature(s) == _state_signature(states[0]) for s in states):
                for name in _state_tensor_names(states[0]):
                    _flatten_into_one([s[name] for s in states])


def fuse_step(optimizer: torch.optim.Optimizer, closure=None):
    """One ``step()`` of ``optimizer`` with every run of parameters that lies
    contiguously in weights, gradients and state updated as one tensor.
    Returns what ``step`` returns."""
    if not is_fused_optimizer(optimizer):
        raise InvalidArgumentError("fuse_step: call bagua.torch_api.contrib.fuse_optimizer(optimizer) first")
    saved = []  # (group, its params) to put back
    fused: List[Tuple[torch.nn.Parameter, List[torch.Tensor]]] = []
    try:
        for group in optimizer.param_groups:
            _gather_gradients(optimizer, group["params"])
            runs = _fusable_runs(optimizer, group["params"])
            if not runs:
                continue
            saved.append((group, group["params"]))
            optimizer._bagua_fused_count += 1
            in_runs = {i for run in runs for i in run}
            new_params = []
            for run in runs:
                members = [group["params"][i] for i in run]
                parameter = _fused_parameter(optimizer, members)
                fused.append((parameter, members))
                new_params.append(parameter)
            group["params"] = new_params + [p for i, p in enumerate(group["params"]) if i not in in_runs]
        optimizer._bagua_fused_runs.append(sum(len(m) for _, m in fused))
        return optimizer.step(closure) if closure is not None else optimizer.step()
    finally:
        for group, params in saved:
            group["params"] = params
        for parameter, members in fused:
            _split_state(optimizer, parameter, members)


def _gather_gradients(optimizer, params: Sequence[torch.Tensor]) -> None:
    """Where the weights (and state) of parameters lie back to back but
    their gradients, allocated anew by autograd, do not: copies the
    gradients into one buffer and points each at its part."""
    with_grad = [p for p in params if p.grad is not None and "_bagua_runtime" not in p.__dict__
                 and p.grad.is_contiguous() and p.grad.dtype == p.dtype and p.grad.device == p.device]
    if len(with_grad) < 2:
        return
    lists = [[p.data for p in with_grad]]
    if len({_state_signature(optimizer.state.get(p, {})) for p in with_grad}) == 1:
        for name in _state_tensor_names(optimizer.state.get(with_grad[0], {})):
            lists.append([optimizer.state[p][name] for p in with_grad])
    for run in calculate_mutual_groups(lists):
        grads = [with_grad[i].grad for i in run]
        if all(_is_next(a, b) for a, b in zip(grads, grads[1:])):
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        offset = 0
        for i in run:
            p = with_grad[i]
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def _fusable_runs(optimizer, params: Sequence[torch.Tensor]) -> List[List[int]]:
    """Runs of ``params`` whose weights, gradients and state tensors each lie
    back to back in the same order, with equal state names and scalars."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    if len(with_grad) < 2:
        return []
    candidates = [params[i] for i in with_grad]
    signatures = [_state_signature(optimizer.state.get(p, {})) for p in candidates]
    lists = [[p.data for p in candidates], [p.grad for p in candidates]]
    if len(set(signatures)) == 1:
        for name in _state_tensor_names(optimizer.state.get(candidates[0], {})):
            lists.append([optimizer.state[p][name] for p in candidates])
    # (with mixed signatures, runs of equal ones remain; their state is checked below)
    runs = []
    for run in calculate_mutual_groups(lists):
        if len({signatures[i] for i in run}) != 1 or not _states_contiguous(optimizer, [candidates[i] for i in run]):
            continue
        runs.append([with_grad[i] for i in run])
    return runs


def _states_contiguous(optimizer, members: Sequence[torch.Tensor]) -> bool:
    state = optimizer.state.get(members[0], {})
    for name in _state_tensor_names(state):
        tensors = [optimizer.state[m][name] for m in members]
        if any(not _is_next(a, b) for a, b in zip(tensors, tensors[1:])):
            return False
    return True


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor over contiguous ``tensors`` (a view of their memory)."""
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        _storage(first), first.storage_offset(), (total,))


def _fused_parameter(optimizer, members: List[torch.nn.Parameter]) -> torch.nn.Parameter:
    with torch.no_grad():
        parameter = torch.nn.Parameter(_span([m.data for m in members]), requires_grad=False)
        parameter.grad = _span([m.grad for m in members])
    state = optimizer.state.get(members[0], {})
    fused_state = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            fused_state[name] = _span([optimizer.state[m][name] for m in members])
        elif isinstance(value, torch.Tensor):
            fused_state[name] = value.clone()
        else:
            fused_state[name] = value
    if fused_state:
        optimizer.state[parameter] = fused_state
    return parameter


def _split_state(optimizer, parameter: torch.nn.Parameter, members: List[torch.nn.Parameter]) -> None:
    """After the step: every member's state is its part of the fused state
    (views, so state created by this step stays contiguous for the next
    fuse_step; scalars copied)."""
    fused_state = optimizer.state.pop(parameter, None)
    if not fused_state:
        return
    offset = 0
    for m in members:
        state = optimizer.state[m]
        for name, value in fused_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[name] = value[offset:offset + m.numel()].view_as(m)
            elif isinstance(value, torch.Tensor):
                if isinstance(state.get(name), torch.Tensor):
                    state[name].copy_(value)
                else:
                    state[name] = value.clone()
            else:
                state[name] = value
        offset += m.numel()


def fused_parameter_counts(optimizer) -> List[int]:
    """Per ``fuse_step`` so far: how many parameters were updated inside
    fused runs (the rest were updated one by one)."""
    return list(getattr(optimizer, "_bagua_fused_runs", []))


class FusedOptimizer:
    """Bagua 0.8's form of :func:`fuse_optimizer`: ``FusedOptimizer(optimizer,
    do_flatten=False)`` makes ``optimizer`` fusable in place (flattening its
    parameters with ``do_flatten``) and stands for it, with ``step`` the fused
    step. Everything else (``param_groups``, ``state``, ``zero_grad``,
    ``state_dict``, ...) is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, do_flatten: bool = False):
        self.optimizer = fuse_optimizer(optimizer, do_flatten=do_flatten)

    def step(self, closure=None):
        return self.optimizer.fuse_step(closure)

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"FusedOptimizer({self.optimizer!r})"
