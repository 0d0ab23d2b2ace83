"""BlueFog's one-sided windows (``win_*``) on bagua's C++ ``WindowService``.

The service (``include/bagua/runtime/window_service.h``) runs a progress
thread per process on communicators of its own, so a put or get completes
while its target computes and calls nothing (passive target), and window
traffic never meets the neighbour ops or collectives. It is created
collectively by the first ``win_create``.

Every window call runs on one window worker thread in issue order (a
blocking call is its nonblocking form followed by ``win_wait``), so the
service's client side sees one order; the calls never queue behind the
neighbour ops of ``_ops``. Each wait is bounded by BAGUA_COMM_TIMEOUT_S and
its error names the rank, the op and the window.

Windows hold float32 or float64 tensors. A host tensor is live memory:
``win_get`` reads what it holds when the request arrives, and ``win_update``
writes into it. A CUDA tensor is staged: the service works on a pinned host
mirror, refreshed from the device at each of this rank's window calls on
that window (so a neighbour's ``win_get`` reads the tensor as of this rank's
last window call), and ``win_update`` and a put's ``self_weight`` write
their result back to the device before the call completes.
"""

import atexit
import concurrent.futures
import contextlib
from typing import Dict, List, Optional

import torch

from bagua.bluefog import _state, topology_util
from bagua.bluefog._state import state
from bagua.torch_api._core import core, tensor_view


class _Windows:
    """The window side of BlueFog's state, made by the first win_create."""

    def __init__(self, st):
        # new_group on BlueFog's communicator is collective: on its worker
        # thread, in order with the neighbour ops that use it.
        self.service = st.worker.submit(core.WindowService, st.comm).result()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="bagua-bluefog-win")
        self.tensors: Dict[str, torch.Tensor] = {}  # kept alive while registered
        # CUDA windows: the pinned host copy the service works on.
        self.mirrors: Dict[str, torch.Tensor] = {}
        self.handles: Dict[int, concurrent.futures.Future] = {}
        self.next_handle = 0

    def close(self):
        self.executor.shutdown(wait=True)
        self.service = None  # joins the progress thread
        self.tensors.clear()
        self.mirrors.clear()


_with_p = False


def _windows(create: Optional[str] = None) -> Optional[_Windows]:
    """The window state; ``create``: the name of the window whose creation
    starts the service if needed (named in its errors)."""
    st = state()
    if getattr(st, "windows", None) is None and create is not None:
        try:
            st.windows = _Windows(st)
        except Exception as error:  # same type, now naming the call
            raise type(error)(f"win_create on rank {st.comm.rank} (window {create!r}): starting "
                              f"the window service (collective): {error}") from error
    return getattr(st, "windows", None)


def close() -> None:
    """Ends the window service of this process (bf.shutdown and exit)."""
    if _state._state is not None and getattr(_state._state, "windows", None) is not None:
        _state._state.windows.close()
        _state._state.windows = None


atexit.register(close)


def _submit(fn) -> int:
    w = _windows()
    handle = w.next_handle
    w.next_handle += 1
    w.handles[handle] = w.executor.submit(fn)
    return handle


def _run(fn):
    """Runs fn on the window thread (after every call issued before) and
    returns its result."""
    return win_wait(_submit(fn), result=True)


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a CUDA tensor (pinned, for the copies back and forth),
    made once torch's current stream has produced it."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)  # synchronous: waits for the device
    return host


def _host_side(w: _Windows, name: str) -> torch.Tensor:
    """The memory the service reads for window ``name``: the registered host
    tensor, or a CUDA window's mirror refreshed from the device."""
    mirror = w.mirrors.get(name)
    if mirror is None:
        return w.tensors[name]
    mirror.copy_(w.tensors[name])
    return mirror


def _require(name: str, op: str) -> _Windows:
    w = _windows()
    if w is None or name not in w.tensors:
        raise ValueError(f"{op} on rank {_state.rank()}: no window named {name!r} (created: "
                         f"{sorted(w.tensors) if w else []})")
    return w


def _weights(op: str, arg: str, weights, allowed: List[int], kind: str) -> Dict[int, float]:
    """``weights`` (a dict, or a list meaning weight 1) checked against the
    allowed neighbours; ValueError names the strays."""
    if isinstance(weights, dict):
        out = {int(r): float(v) for r, v in weights.items()}
    else:
        ranks = [int(r) for r in weights]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{op}: {arg} names a rank twice: {ranks}")
        out = {r: 1.0 for r in ranks}
    stray = sorted(set(out) - set(allowed))
    if stray:
        raise ValueError(f"{op} on rank {_state.rank()}: {arg} names {stray}, not {kind} "
                         f"({allowed}; self is not allowed)")
    return out


# -- creation -------------------------------------------------------------------------
def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False) -> bool:
    """Collective: registers ``tensor`` (live memory) as window ``name`` with
    one buffer per in-neighbour, a copy of ``tensor`` (zeros with
    ``zero_init``); versions 0, associated p 1. False on every rank if a rank
    already has ``name``."""
    w = _windows(create=name)
    refusal = ""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"win_create: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        refusal = f"window tensors must be in host or CUDA memory, got {tensor.device}"
    elif not tensor.is_contiguous():
        refusal = "window tensors must be contiguous (the window is the tensor's own memory)"
    elif tensor.dtype not in (torch.float32, torch.float64):
        refusal = f"windows hold float32 or float64 tensors, got {tensor.dtype}"
    mirror = None
    if refusal:
        view = core.TensorView(0, 0, "float32", "cpu")
    else:
        mirror = _staged(tensor) if tensor.is_cuda else None
        view = tensor_view(tensor if mirror is None else mirror)
    sources = _state.in_neighbor_ranks()

    def run():
        return w.service.create(name, view, sources, bool(zero_init), refusal)

    created = _run(run)
    if created:
        w.tensors[name] = tensor
        if mirror is not None:
            w.mirrors[name] = mirror
    return created


def win_free(name: Optional[str] = None) -> bool:
    """Collective: frees window ``name`` (None: all). Every rank first
    finishes its window calls; True also when no window exists; False if a
    rank lacks ``name``."""
    w = _windows()
    if w is None:
        return True
    freed = _run(lambda: w.service.free(name or ""))
    if freed:
        if name is None:
            w.tensors.clear()
            w.mirrors.clear()
        else:
            w.tensors.pop(name, None)
            w.mirrors.pop(name, None)
    return freed


def get_current_created_window_names() -> List[str]:
    w = _windows()
    return w.service.names() if w is not None else []


# -- one-sided ops --------------------------------------------------------------------
def _check_tensor(op: str, tensor: torch.Tensor, registered: torch.Tensor) -> None:
    if (not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "cuda")
            or not tensor.is_contiguous() or tensor.dtype != registered.dtype
            or tensor.numel() != registered.numel()):
        raise ValueError(f"{op} on rank {_state.rank()}: the tensor must be a contiguous host "
                         f"or CUDA tensor of {registered.numel()} elements of {registered.dtype}, "
                         "like the window's")


def _put_nonblocking(op: str, tensor, name, self_weight, dst_weights, require_mutex,
                     accumulate) -> int:
    w = _require(name, op)
    _check_tensor(op, tensor, w.tensors[name])
    outs = _state.out_neighbor_ranks()
    dsts = _weights(op, "dst_weights", outs if dst_weights is None else dst_weights, outs,
                    "out-neighbours")
    self_weight = 1.0 if self_weight is None else float(self_weight)
    _host_side(w, name)  # a CUDA window's neighbours read it as of this call
    host = _staged(tensor) if tensor.is_cuda else tensor
    view, with_p = tensor_view(host), _with_p

    def run():
        done = w.service.put(name, view, sorted(dsts.items()), self_weight=self_weight,
                             accumulate=accumulate, require_mutex=bool(require_mutex), with_p=with_p)
        if host is not tensor and self_weight != 1.0:
            tensor.copy_(host)  # the in-place self_weight scaling
            if tensor is w.tensors.get(name) and name in w.mirrors:
                w.mirrors[name].copy_(host)  # the window's own tensor: neighbours see it scaled
        return done
    return _submit(run)


def win_put_nonblocking(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
                        dst_weights=None, require_mutex: bool = False) -> int:
    """For each d of ``dst_weights`` (default: every out-neighbour, weight
    1): d's buffer for this rank := weight * tensor, its version +1; then
    tensor *= self_weight (default 1) in place. Returns a handle for
    win_poll / win_wait; do not modify ``tensor`` before the wait."""
    return _put_nonblocking("win_put", tensor, name, self_weight, dst_weights, require_mutex,
                            False)


def win_put(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
            dst_weights=None, require_mutex: bool = False) -> bool:
    return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


neighbor_win_put = win_put
neighbor_win_put_nonblocking = win_put_nonblocking


def win_accumulate_nonblocking(tensor: torch.Tensor, name: str,
                               self_weight: Optional[float] = None, dst_weights=None,
                               require_mutex: bool = False) -> int:
    """As win_put, adding into the destination's buffer (versions unchanged,
    as in BlueFog)."""
    return _put_nonblocking("win_accumulate", tensor, name, self_weight, dst_weights,
                            require_mutex, True)


def win_accumulate(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
                   dst_weights=None, require_mutex: bool = False) -> bool:
    return win_wait(win_accumulate_nonblocking(tensor, name, self_weight, dst_weights,
                                               require_mutex))


def win_get_nonblocking(name: str, src_weights=None, require_mutex: bool = False) -> int:
    """For each s of ``src_weights`` (default: every in-neighbour, weight 1):
    this rank's buffer for s := weight * s's registered tensor as it is when
    the request arrives; its version +1."""
    w = _require(name, "win_get")
    ins = _state.in_neighbor_ranks()
    srcs = _weights("win_get", "src_weights", ins if src_weights is None else src_weights, ins,
                    "in-neighbours")
    with_p = _with_p
    _host_side(w, name)
    return _submit(lambda: w.service.get(name, sorted(srcs.items()),
                                         require_mutex=bool(require_mutex), with_p=with_p))


def win_get(name: str, src_weights=None, require_mutex: bool = False) -> bool:
    return win_wait(win_get_nonblocking(name, src_weights, require_mutex))


def win_update(name: str, self_weight: Optional[float] = None, neighbor_weights=None,
               reset: bool = False, clone: bool = False,
               require_mutex: bool = False) -> torch.Tensor:
    """t = self_weight * x + sum_j w_j * buffer_j, written into the window's
    tensor and returned (a new tensor with ``clone``). Default: the uniform
    average over self and the in-neighbours (summed, then divided once), or
    the topology's receive weights when it is weighted. ``reset`` zeroes
    the named buffers afterwards (all in-neighbours' by default); versions
    go to 0. Give both weights or neither (else ValueError)."""
    w = _require(name, "win_update")
    ins = _state.in_neighbor_ranks()
    divisor = 1.0
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError("win_update: give both self_weight and neighbor_weights, or neither")
    if self_weight is None:
        if _state.is_topo_weighted():
            self_weight, neighbor_weights = topology_util.GetRecvWeights(
                _state.load_topology(), _state.rank())
        else:
            self_weight, neighbor_weights = 1.0, {r: 1.0 for r in ins}
            divisor = float(len(ins) + 1)
    if not isinstance(neighbor_weights, dict):
        raise ValueError("win_update: neighbor_weights must be a dict {in-neighbour: weight}")
    weights = _weights("win_update", "neighbor_weights", neighbor_weights, ins, "in-neighbours")
    registered = w.tensors[name]
    host = _host_side(w, name)
    out = host.clone() if clone else host
    view, with_p = tensor_view(out), _with_p
    _run(lambda: w.service.update(
        name, float(self_weight), sorted(weights.items()), divisor=divisor, reset=bool(reset),
        out=view, require_mutex=bool(require_mutex), with_p=with_p))
    if host is registered:
        return out
    if clone:
        return out.to(registered.device)
    registered.copy_(host)
    return registered


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """x += sum of the in-neighbours' buffers, then the buffers := 0 (and p
    likewise): win_update(name, 1.0, {in: 1.0}, reset=True)."""
    return win_update(name, 1.0, {r: 1.0 for r in _state.in_neighbor_ranks()}, reset=True,
                      require_mutex=require_mutex)


def get_win_version(name: str) -> Dict[int, int]:
    """{in-neighbour: puts and gets into its buffer since the last update}."""
    w = _require(name, "get_win_version")
    return dict(w.service.versions(name))


# -- handles --------------------------------------------------------------------------
def win_poll(handle: int) -> bool:
    """Whether the window call of ``handle`` finished (win_wait still needed)."""
    w = _windows()
    if w is None or handle not in w.handles:
        raise ValueError(f"win_poll: unknown window handle {handle!r}")
    return w.handles[handle].done()


def win_wait(handle: int, result: bool = False):
    """Waits for the window call of ``handle``; True, or its error raised.
    Each call bounds its own waits by BAGUA_COMM_TIMEOUT_S; this wait is a
    backstop allowing every call queued before it its timeout too."""
    w = _windows()
    if w is None or handle not in w.handles:
        raise ValueError(f"win_wait: unknown window handle {handle!r} (already waited for?)")
    future = w.handles[handle]
    limit = core.env().comm_timeout_s * (2 + len(w.handles)) + 60
    try:
        value = future.result(timeout=limit)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        raise TimeoutError(f"bluefog window call on rank {_state.rank()}: handle {handle} did "
                           f"not finish within {limit:.0f} s") from None
    finally:
        del w.handles[handle]
    return value if result else True


# -- mutex and associated p -----------------------------------------------------------
@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Optional[List[int]] = None):
    """Holds the distributed mutexes of window ``name`` at ``ranks``
    (default: the out-neighbours), or this rank's own with ``for_self``;
    acquired in ascending rank order, FIFO per mutex."""
    w = _require(name, "win_mutex")
    if for_self:
        held = [_state.rank()]
    else:
        held = sorted({int(r) for r in (_state.out_neighbor_ranks() if ranks is None else ranks)})
    _run(lambda: w.service.lock(name, held))
    try:
        yield
    finally:
        _run(lambda: w.service.unlock(name, held))


def turn_on_win_ops_with_associated_p() -> None:
    """From now on every window op applies to the associated p as to the
    tensor (put: w*p, accumulate: +w*p, self_weight scales p, update
    combines p with the same weights). Off by default."""
    global _with_p
    _with_p = True


def turn_off_win_ops_with_associated_p() -> None:
    global _with_p
    _with_p = False


def win_associated_p(name: str) -> float:
    """This rank's associated p of window ``name`` (1 at creation)."""
    w = _require(name, "win_associated_p")
    return w.service.associated_p(name)
