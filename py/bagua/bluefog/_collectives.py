"""BlueFog's collectives: allreduce, broadcast, allgather, barrier, and the
broadcasts of parameters and optimizer state.

They return new tensors (the ``_`` forms write into the input), run on
BlueFog's worker thread in issue order like the neighbour ops (``_ops``), on
BlueFog's own communicator, through bagua's primitives, which check that every
rank passed the same sizes (a mismatch is a ValueError on every rank).
"""

import io
from typing import Optional

import torch

from bagua.bluefog import _ops
from bagua.bluefog._state import state
from bagua.torch_api import communication as comm_api

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _allreduce(x: torch.Tensor, out: torch.Tensor, average: bool, local: bool) -> None:
    comm = state().local_comm if local else state().comm
    if average and x.dtype not in _FLOATS:
        raise ValueError(f"allreduce: averaging needs a floating point tensor, got {x.dtype}; "
                         "use average=False for integers")
    op = comm_api.ReduceOp.AVG if average else comm_api.ReduceOp.SUM
    comm_api.allreduce(x, out, op, comm=comm)


def allreduce_nonblocking(tensor: torch.Tensor, average: bool = True,
                          is_hierarchical_local: bool = False, name: Optional[str] = None) -> int:
    """The average (or sum) over all ranks, or over this machine's ranks with
    ``is_hierarchical_local``."""
    x = _ops._host(tensor)

    def run():
        out = torch.empty_like(x)
        _allreduce(x, out, average, is_hierarchical_local)
        return out.to(tensor.device)
    return _ops._submit(run, "ALLREDUCE", name)


def allreduce(tensor, average=True, is_hierarchical_local=False, name=None) -> torch.Tensor:
    return _ops.synchronize(allreduce_nonblocking(tensor, average, is_hierarchical_local, name))


def allreduce_nonblocking_(tensor, average=True, is_hierarchical_local=False, name=None) -> int:
    return _inplace(tensor, allreduce_nonblocking(tensor, average, is_hierarchical_local, name))


def allreduce_(tensor, average=True, is_hierarchical_local=False, name=None) -> torch.Tensor:
    return _ops.synchronize(allreduce_nonblocking_(tensor, average, is_hierarchical_local, name))


def _inplace(tensor: torch.Tensor, handle: int) -> int:
    """A handle whose result is also written into ``tensor``."""
    def run():
        result = _ops.synchronize(handle)
        tensor.copy_(result)
        return tensor
    # Queued after the call itself, so the copy happens once it is done;
    # synchronizing `handle` from the worker is safe (it already ran).
    return _ops._submit(run, "COPY_BACK")


def broadcast_nonblocking(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> int:
    """``tensor`` of rank ``root_rank`` on every rank."""
    x = _ops._as_movable(_ops._host(tensor).clone())

    def run():
        comm_api.broadcast(x, root_rank, comm=state().comm)
        return _ops._from_movable(x, tensor).to(tensor.device).view(tensor.shape)
    return _ops._submit(run, "BROADCAST", name)


def broadcast(tensor, root_rank, name=None) -> torch.Tensor:
    return _ops.synchronize(broadcast_nonblocking(tensor, root_rank, name))


def broadcast_nonblocking_(tensor, root_rank, name=None) -> int:
    return _inplace(tensor, broadcast_nonblocking(tensor, root_rank, name))


def broadcast_(tensor, root_rank, name=None) -> torch.Tensor:
    return _ops.synchronize(broadcast_nonblocking_(tensor, root_rank, name))


def _allgather(x: torch.Tensor) -> torch.Tensor:
    """Concatenation along dim 0; the first dimension may differ per rank
    (the rows are padded to the longest and cut after)."""
    comm = state().comm
    n = comm.size
    x = x.reshape(1) if x.dim() == 0 else x
    rows = torch.tensor([x.shape[0]], dtype=torch.int64)
    all_rows = torch.empty(n, dtype=torch.int64)
    comm_api.allgather(rows, all_rows, comm=comm)
    longest = int(all_rows.max())
    padded = torch.zeros((longest,) + tuple(x.shape[1:]), dtype=x.dtype)
    padded[:x.shape[0]] = x
    gathered = torch.empty((n * longest,) + tuple(x.shape[1:]), dtype=x.dtype)
    comm_api.allgather(padded, gathered, comm=comm)
    parts = [gathered[r * longest:r * longest + int(all_rows[r])] for r in range(n)]
    return torch.cat(parts)


def allgather_nonblocking(tensor: torch.Tensor, name: Optional[str] = None) -> int:
    x = _ops._as_movable(_ops._host(tensor))
    return _ops._submit(lambda: _ops._from_movable(_allgather(x), tensor).to(tensor.device),
                        "ALLGATHER", name)


def allgather(tensor, name=None) -> torch.Tensor:
    return _ops.synchronize(allgather_nonblocking(tensor, name))


def barrier() -> None:
    _ops.synchronize(_ops._submit(lambda: state().comm.barrier(), "BARRIER"))


def _tensors_of(params):
    """(name, tensor) pairs of a state_dict, named_parameters or a list."""
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda item: str(item[0]))
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(str(i), p) for i, p in enumerate(items)]


def broadcast_parameters(params, root_rank: int) -> None:
    """Every tensor of ``params`` (state_dict, named parameters or list) takes
    rank ``root_rank``'s value, in place."""
    handles = []
    for name, p in _tensors_of(params):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name} is a {type(p).__name__}, not a tensor")
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_nonblocking_(target, root_rank, name=f"parameter.{name}"))
    for handle in handles:
        _ops.synchronize(handle)


def allreduce_parameters(params) -> None:
    """Every tensor of ``params`` becomes its average over ranks, in place."""
    handles = []
    for name, p in _tensors_of(params):
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(allreduce_nonblocking_(target, name=f"parameter.{name}"))
    for handle in handles:
        _ops.synchronize(handle)


def broadcast_object(obj, root_rank: int = 0):
    """Rank ``root_rank``'s picklable ``obj`` on every rank."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    length = broadcast(torch.tensor([data.numel()], dtype=torch.int64), root_rank)
    payload = torch.zeros(int(length[0]), dtype=torch.uint8)
    if state().comm.rank == root_rank:
        payload.copy_(data)
    payload = broadcast(payload, root_rank)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """The optimizer takes rank ``root_rank``'s state and options (lr...),
    also when its own state is still empty. Parameters are matched by their
    position in the param groups, as in ``Optimizer.state_dict``."""
    state_dict = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state_dict)
