"""BlueFog's communication calls: neighbour ops, collectives, handles.

Every call is queued to BlueFog's worker thread (``_fusion.Worker``) in
issue order and a blocking call is its nonblocking form followed by
``synchronize``, so calls in flight never interleave on a communicator and
every rank issues them in the same order. Pending ``neighbor_allreduce``
calls of one pattern may run fused as one op (``_fusion``), invisibly: each
handle gets its own result, bit for bit. The neighbour ops are the C++ ops of
``include/bagua/ops/neighbor_*.h``; each waits at most BAGUA_COMM_TIMEOUT_S,
and with ``enable_topo_check`` (the default) a mismatched send/receive
pattern raises ValueError on every rank before anything is sent.

Tensors travel through host memory where the communicator cannot reach
theirs; the input is never modified except by the ``_`` forms. A
nonblocking call may read its input until it is synchronized (as in
BlueFog): do not modify it in place before then.
"""

import concurrent.futures
from typing import Dict, List, Optional, Union

import torch

from bagua.bluefog import _fusion, _state, _timeline, topology_util
from bagua.bluefog._state import state
from bagua.torch_api._core import core, dtype_name, tensor_view


# -- handles --------------------------------------------------------------------------
def _submit(fn, activity: str, name: Optional[str] = None) -> int:
    """Queues ``fn`` on the worker thread; ``activity`` and ``name`` label its
    timeline span."""
    return _handle(state().worker.submit(_timeline.traced(fn, activity, name)))


def _handle(future) -> int:
    st = state()
    handle = st.next_handle
    st.next_handle += 1
    st.handles[handle] = future
    return handle


def _future(handle: int):
    futures = state().handles
    if handle not in futures:
        raise ValueError(f"handle {handle!r} was not returned by a nonblocking call, or was "
                         "already synchronized")
    return futures[handle]


def poll(handle: int) -> bool:
    """Whether the call of ``handle`` has finished (synchronize still needed)."""
    return _future(handle).done()


def synchronize(handle: int):
    """Waits for the call of ``handle`` and returns its output; its error, if
    it failed, is raised here. Each op bounds its own waits by
    BAGUA_COMM_TIMEOUT_S; this wait is only a backstop, allowing every call
    queued before this one its timeout too."""
    future = _future(handle)
    limit = core.env().comm_timeout_s * (1 + len(state().handles)) + 60
    try:
        with state().worker.waiting():  # the worker stops waiting for more calls to fuse
            return future.result(timeout=limit)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise  # the call's own timeout (concurrent's TimeoutError is the builtin one)
        raise TimeoutError(f"bluefog: rank {_state.rank()}: handle {handle} did not finish within "
                           f"{limit:.0f} s") from None
    finally:
        del state().handles[handle]


wait = synchronize


def _blocking(handle: int):
    return synchronize(handle)


# -- tensors on the communicator ------------------------------------------------------
def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous, in memory the communicator reaches."""
    comm = state().comm
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    if not comm.supports(str(tensor.device.type)):
        tensor = tensor.detach().to("cpu")
    return tensor.detach().contiguous()


_MOVABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
            torch.uint8)


def _as_movable(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where the engine has its dtype; else its bytes, one row
    per row of ``x`` (int8, int16, bool...: ops that only move data need no
    arithmetic on them). :func:`_from_movable` undoes it."""
    if x.dtype in _MOVABLE:
        return x
    rows = x.shape[0] if x.dim() > 0 else 1
    row = 1
    for d in x.shape[1:]:
        row *= d
    return x.contiguous().reshape(rows, row).view(torch.uint8)


def _from_movable(moved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows of ``moved`` (from :func:`_as_movable`) as ``like``'s dtype and
    trailing shape."""
    if like.dtype in _MOVABLE:
        return moved
    return moved.view(like.dtype).reshape((-1,) + tuple(like.shape[1:]))


def _view(tensor: torch.Tensor):
    return tensor_view(tensor, allow_cuda=True)


# -- neighbor_allreduce ---------------------------------------------------------------
def _check_weights(what: str, weights) -> Dict[int, float]:
    if isinstance(weights, dict):
        items = list(weights.items())
    else:
        items = [(r, 1.0) for r in weights]
        if len({int(r) for r in weights}) != len(items):
            raise ValueError(f"{what} names a rank twice: {list(weights)}")
    out = {}
    for r, w in items:
        if isinstance(r, bool) or not isinstance(r, int) and not hasattr(r, "__index__"):
            raise ValueError(f"{what}: ranks must be integers, got {r!r}")
        out[int(r)] = float(w)
    return out


class _Graph:
    """The static pattern a call falls back on: this node's in-/out-neighbours
    and the weights of a weighted topology (None when unweighted)."""

    def __init__(self, op: str, me: int, topology, is_weighted: bool, what: str = "rank"):
        self.op, self.me, self.what = op, me, what
        self.ins = sorted(r for r in topology.predecessors(me) if r != me)
        self.outs = sorted(r for r in topology.successors(me) if r != me)
        self.topology = topology if is_weighted else None


def _rank_graph(op: str) -> _Graph:
    st = state()
    return _Graph(op, _state.rank(), st.topology, st.is_weighted)


def _neighbor_options(graph: _Graph, self_weight, src_weights, dst_weights, enable_topo_check,
                      name, src_arg="src_weights", dst_arg="dst_weights"):
    """The C++ options of one call, per the table of design section 7."""
    pattern = _neighbor_pattern(graph, self_weight, src_weights, dst_weights, enable_topo_check,
                                src_arg, dst_arg)
    return core.NeighborAllreduceOptions(name=name or "", **pattern)


def _neighbor_pattern(graph: _Graph, self_weight, src_weights, dst_weights, enable_topo_check,
                      src_arg="src_weights", dst_arg="dst_weights") -> dict:
    """The keyword arguments of the C++ options of one call but its name
    (what calls must share to be fused)."""
    op = graph.op
    if (self_weight is None) != (src_weights is None):
        raise ValueError(f"{op}: give both self_weight and {src_arg}, or neither")
    if dst_weights is not None and self_weight is None:
        raise ValueError(f"{op}: {dst_arg} needs self_weight and {src_arg} too")
    kw = dict(check_pattern=bool(enable_topo_check))
    to_outs = [(r, 1.0) for r in graph.outs]
    if self_weight is None:
        if graph.topology is not None:
            self_weight, weights = topology_util.GetRecvWeights(graph.topology, graph.me)
            return dict(self_weight=float(self_weight), sources=sorted(weights.items()),
                        destinations=to_outs, **kw)
        return dict(sources=[(r, 1.0) for r in graph.ins], destinations=to_outs, **kw)
    sources = _check_weights(src_arg, src_weights)
    if dst_weights is None:
        unknown = sorted(set(sources) - set(graph.ins))
        if unknown:
            raise ValueError(f"{op}: {src_arg} names {unknown}, not in-neighbours of "
                             f"{graph.what} {graph.me} ({graph.ins}); pass {dst_arg} too for a "
                             "dynamic pattern")
        return dict(self_weight=float(self_weight), sources=sorted(sources.items()),
                    ignored_sources=[r for r in graph.ins if r not in sources],
                    destinations=to_outs, **kw)
    destinations = _check_weights(dst_arg, dst_weights)
    return dict(self_weight=float(self_weight), sources=sorted(sources.items()),
                destinations=sorted(destinations.items()), **kw)


_RENAMED = {"neighbor_weights": "src_weights", "send_neighbors": "dst_weights"}


def _reject_renamed(op: str, kwargs) -> None:
    for key in kwargs:
        if key in _RENAMED:
            raise TypeError(f"{op}: '{key}' was renamed to '{_RENAMED[key]}' in BlueFog 0.3")
        raise TypeError(f"{op}() got an unexpected keyword argument '{key}'")


def neighbor_allreduce_nonblocking(tensor: torch.Tensor, *, self_weight: Optional[float] = None,
                                   src_weights: Optional[Dict[int, float]] = None,
                                   dst_weights: Union[None, List[int], Dict[int, float]] = None,
                                   enable_topo_check: bool = True, name: Optional[str] = None,
                                   **kwargs) -> int:
    _reject_renamed("neighbor_allreduce", kwargs)
    return _neighbor_allreduce(tensor, self_weight, src_weights, dst_weights, enable_topo_check,
                               name, alone=False)


def _neighbor_allreduce(tensor, self_weight, src_weights, dst_weights, enable_topo_check, name,
                        alone: bool) -> int:
    """Queues one call; ``alone``: a blocking call, never fused, so it needs
    no agreement between the ranks (see _fusion)."""
    if state().skip_negotiate and enable_topo_check is True and dst_weights is None:
        enable_topo_check = False  # static calls on an agreed topology
    pattern = _neighbor_pattern(_rank_graph("neighbor_allreduce"), self_weight, src_weights,
                                dst_weights, enable_topo_check)
    x = _host(tensor)
    call = _fusion.NeighborCall(x, pattern, name, alone=alone,
                                finish=lambda out: out.to(tensor.device).view(tensor.shape))
    return _handle(state().worker.submit_neighbor(call))


def neighbor_allreduce(tensor: torch.Tensor, *, self_weight: Optional[float] = None,
                       src_weights: Optional[Dict[int, float]] = None,
                       dst_weights: Union[None, List[int], Dict[int, float]] = None,
                       enable_topo_check: bool = True, name: Optional[str] = None,
                       **kwargs) -> torch.Tensor:
    """out = self_weight * x + sum_j src_weights[j] * d_j * x_j (see the
    design's table); no weights: the uniform average over the in-neighbours
    (or the topology's weights when it is weighted)."""
    _reject_renamed("neighbor_allreduce", kwargs)
    return _blocking(_neighbor_allreduce(tensor, self_weight, src_weights, dst_weights,
                                         enable_topo_check, name, alone=True))


# -- neighbor_allgather ---------------------------------------------------------------
def _rank_list(what: str, ranks) -> List[int]:
    out = [int(r) for r in list(ranks)]
    if len(set(out)) != len(out):
        raise ValueError(f"{what} names a rank twice: {out}")
    return out


def neighbor_allgather_nonblocking(tensor: torch.Tensor, *, src_ranks=None, dst_ranks=None,
                                   enable_topo_check: bool = True,
                                   name: Optional[str] = None) -> int:
    if (src_ranks is None) != (dst_ranks is None):
        raise ValueError("neighbor_allgather: give both src_ranks and dst_ranks, or neither")
    if src_ranks is None:
        src_ranks, dst_ranks = _state.in_neighbor_ranks(), _state.out_neighbor_ranks()
    options = core.NeighborAllgatherOptions(
        sources=_rank_list("src_ranks", src_ranks), destinations=_rank_list("dst_ranks", dst_ranks),
        check_pattern=bool(enable_topo_check), name=name or "")
    x = _as_movable(_host(tensor))

    def run():
        op = state().neighbor_allgather
        plan = op.plan(dtype_name(x.dtype), x.numel(), options)
        out = _gathered_output(x, plan.counts)
        op.run(plan, _view(x), _view(out))
        return _from_movable(out, tensor).to(tensor.device)
    return _submit(run, "NEIGHBOR_ALLGATHER", name)


def _gathered_output(x: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """The output of gathering blocks of ``counts`` elements along dim 0 of
    tensors shaped like ``x`` beyond their first dimension."""
    row = 1
    for d in x.shape[1:]:
        row *= d
    row = max(row, 1)
    bad = [c for c in counts if c % row != 0]
    if bad:
        raise ValueError(f"neighbor_allgather: rank {_state.rank()} received {bad[0]} elements, "
                         f"not whole rows of {row}: the tensors differ beyond dimension 0")
    return torch.empty((sum(counts) // row,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)


def neighbor_allgather(tensor: torch.Tensor, *, src_ranks=None, dst_ranks=None,
                       enable_topo_check: bool = True, name: Optional[str] = None) -> torch.Tensor:
    """The in-neighbours' tensors (or src_ranks'), concatenated along dim 0 in
    in_neighbor_ranks() order (or src_ranks order), self excluded."""
    return _blocking(neighbor_allgather_nonblocking(
        tensor, src_ranks=src_ranks, dst_ranks=dst_ranks, enable_topo_check=enable_topo_check,
        name=name))


# -- pair_gossip ----------------------------------------------------------------------
def pair_gossip_nonblocking(tensor: torch.Tensor, target_rank: int,
                            self_weight: Optional[float] = None,
                            pair_weight: Optional[float] = None, name: Optional[str] = None) -> int:
    """self_weight * x + pair_weight * x_target (default: the average); both
    partners call it naming each other."""
    return _pair_gossip(tensor, target_rank, self_weight, pair_weight, name, alone=False)


def _pair_gossip(tensor, target_rank, self_weight, pair_weight, name, alone: bool) -> int:
    if (self_weight is None) != (pair_weight is None):
        raise ValueError("pair_gossip: give both self_weight and pair_weight, or neither")
    if self_weight is None:
        self_weight = pair_weight = 0.5
    return _neighbor_allreduce(tensor, self_weight, {int(target_rank): float(pair_weight)},
                               [int(target_rank)], True, name, alone)


def pair_gossip(tensor: torch.Tensor, target_rank: int, self_weight: Optional[float] = None,
                pair_weight: Optional[float] = None, name: Optional[str] = None) -> torch.Tensor:
    return _blocking(_pair_gossip(tensor, target_rank, self_weight, pair_weight, name, alone=True))
