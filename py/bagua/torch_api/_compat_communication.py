"""The rest of Bagua's ``bagua.torch_api.communication``, built on the
primitives of :mod:`bagua.torch_api._primitives` (the module
``communication`` gathers both).

- :class:`CommMember`: ``CommMember.WORLD`` stands for the default group
  wherever a group or communicator is accepted; ``CommMember.NON_COMM_MEMBER``
  marks a rank outside a group (the functions here do nothing on it).
- Collectives the communicator does not have: :func:`alltoall_v` and
  :func:`alltoall_v_inplace` (variable counts, over one padded alltoall),
  :func:`gather_inplace`, :func:`scatter_inplace`,
  :func:`allreduce_coalesced_inplace`, :func:`broadcast_coalesced` and
  :func:`broadcast_object`.
- :func:`from_torch_group` (a ``torch.distributed`` group as a bagua group)
  and :func:`get_backend` (a named runtime backend).
- Bagua's patch of ``torch.distributed``'s process groups:
  ``torch_group.bagua_patch()`` gives a group its bagua group
  (``torch_group.bagua_pg``), recorded in ``_torch_to_bagua_pg_map`` until
  ``torch.distributed.destroy_process_group`` destroys the torch group.
- Bagua's communicator methods on ``bagua_core.Communicator`` (what
  ``group.get_global_communicator()`` returns): ``rank()`` and ``nranks()``,
  the in-place and variable-count collectives, on torch tensors, and
  ``abort()`` / ``check_abort()``: an aborted communicator is cancelled
  (see :mod:`._primitives`).
"""

import functools
import io
import pickle
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import _primitives
from bagua.torch_api import env, timeline
from bagua.torch_api._core import InvalidArgumentError, check_tensor, core
from bagua.torch_api._primitives import ReduceOp
from bagua.torch_api import process_group as _process_group_module
from bagua.torch_api.process_group import BaguaProcessGroup, _get_default_group, new_group

try:  # Bagua pickles with cloudpickle (lambdas, local classes) when it is there
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle

__all__ = [
    "CommMember", "from_torch_group", "get_backend", "broadcast_object", "broadcast_coalesced",
    "allreduce_coalesced_inplace", "gather_inplace", "scatter_inplace", "alltoall_v",
    "alltoall_v_inplace", "init_bagua_communicator",
]


class _DefaultGroup(BaguaProcessGroup):
    """The default group, whichever it is when used: every attribute is read
    from it (so this works before ``init_process_group`` has run)."""

    def __init__(self):  # noqa: D401 - nothing of its own
        pass

    def __getattribute__(self, name):
        return getattr(_get_default_group(), name)

    def __repr__(self) -> str:
        return "CommMember.WORLD"


class CommMember:
    """Bagua's markers for communicators: ``WORLD`` is the default group,
    ``NON_COMM_MEMBER`` what a rank outside a group holds."""

    WORLD = _DefaultGroup()
    NON_COMM_MEMBER = _process_group_module.NON_COMM_MEMBER


def _not_member(comm) -> bool:
    """Bagua's marker, or a group this rank is not in: calls do nothing."""
    if comm is CommMember.NON_COMM_MEMBER:
        return True
    return isinstance(comm, BaguaProcessGroup) and not isinstance(comm, _DefaultGroup) and not comm.is_member()


def _communicator(comm):
    """The communicator a call runs on: ``comm``'s, or the default group's."""
    if comm is None:
        return _get_default_group().get_global_communicator()
    if isinstance(comm, BaguaProcessGroup):
        return comm.get_global_communicator()
    if isinstance(comm, core.Communicator):
        return comm
    raise InvalidArgumentError(
        f"comm must be a BaguaProcessGroup, a communicator, CommMember.WORLD or None, got {type(comm).__name__}")


def _control_device(communicator) -> torch.device:
    """Where the small tensors of a call's bookkeeping (counts, lengths,
    masks) live: host memory, or the current GPU for NCCL, which reaches
    only device memory."""
    if communicator.backend_name.startswith("nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _counts(what: str, values, size: int) -> List[int]:
    values = [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    if len(values) != size:
        raise InvalidArgumentError(f"{what} must have one entry per rank ({size}), got {len(values)}")
    if any(v < 0 for v in values):
        raise InvalidArgumentError(f"{what} must not be negative, got {values}")
    return values


def _displacements(what: str, values, size: int) -> List[int]:
    """One offset per rank. Bagua read the first ``size`` entries and let a
    longer list through; its examples pass exclusive prefix sums with the
    total appended (``size + 1`` entries), so that one extra entry is
    accepted and ignored, and any other length is refused."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(values) == size + 1:
        values = values[:size]
    if len(values) != size:
        raise InvalidArgumentError(f"{what} must have one entry per rank ({size}), or one more (the "
                                   f"total, ignored), got {len(values)}")
    return _counts(what, values, size)


def _check_layout(what: str, tensor, counts: List[int], displs: List[int]) -> None:
    for peer, (count, displ) in enumerate(zip(counts, displs)):
        if displ + count > tensor.numel():
            raise InvalidArgumentError(
                f"alltoall_v: {what} entry {peer} ({count} elements at {displ}) lies outside the "
                f"tensor of {tensor.numel()} elements")


# -- collectives ---------------------------------------------------------------
def alltoall_v(send_tensor: torch.Tensor, send_counts, send_displs, recv_tensor: torch.Tensor,
               recv_counts, recv_displs, comm=None) -> None:
    """Each rank sends ``send_counts[j]`` elements from offset
    ``send_displs[j]`` of its ``send_tensor`` to rank ``j``, and puts what
    rank ``i`` sends it at offset ``recv_displs[i]`` of ``recv_tensor``.
    ``recv_counts[i]`` is the most rank ``i`` may send (elements of
    ``recv_tensor`` past what arrives are left as they were). Counts and
    displacements are in elements of the flattened tensors; a displacement
    list may carry one more entry, the total, which is ignored (as Bagua did).

    Every rank first learns every rank's counts (one allgather), so a rank
    sending more than its peer can receive is an error on every rank; the
    data then moves in one alltoall of chunks padded to the largest count.
    """
    if _not_member(comm):
        return
    communicator = _communicator(comm)
    size, rank = communicator.size, communicator.rank
    check_tensor(send_tensor, "send_tensor")
    check_tensor(recv_tensor, "recv_tensor")
    if send_tensor.dtype != recv_tensor.dtype or send_tensor.device != recv_tensor.device:
        raise InvalidArgumentError(
            f"alltoall_v: send_tensor ({send_tensor.dtype}, {send_tensor.device}) and recv_tensor "
            f"({recv_tensor.dtype}, {recv_tensor.device}) differ in dtype or device")
    send_counts, send_displs = _counts("send_counts", send_counts, size), _displacements("send_displs", send_displs, size)
    recv_counts, recv_displs = _counts("recv_counts", recv_counts, size), _displacements("recv_displs", recv_displs, size)
    _check_layout("send", send_tensor, send_counts, send_displs)
    _check_layout("recv", recv_tensor, recv_counts, recv_displs)

    # Row r of `table`: rank r's send counts, then its receive capacities.
    device = _control_device(communicator)
    mine = torch.tensor(send_counts + recv_counts, dtype=torch.int64, device=device)
    table = torch.empty(size * 2 * size, dtype=torch.int64, device=device)
    _primitives.allgather(mine, table, comm=communicator)
    table = table.cpu().view(size, 2, size)
    sends, capacities = table[:, 0, :], table[:, 1, :]
    too_much = (sends > capacities.t()).nonzero().tolist()
    if too_much:
        src, dst = too_much[0]
        raise InvalidArgumentError(
            f"alltoall_v: rank {src} sends {int(sends[src, dst])} elements to rank {dst}, which "
            f"receives at most {int(capacities[dst, src])} from it")
    chunk = int(sends.max())
    if chunk == 0:
        return
    send_flat, recv_flat = send_tensor.view(-1), recv_tensor.view(-1)
    padded_send = send_tensor.new_zeros(size * chunk)
    for peer in range(size):
        count = send_counts[peer]
        padded_send[peer * chunk:peer * chunk + count] = send_flat[send_displs[peer]:send_displs[peer] + count]
    padded_recv = torch.empty_like(padded_send)
    _primitives.alltoall(padded_send, padded_recv, comm=communicator)
    for peer in range(size):
        count = int(sends[peer, rank])
        recv_flat[recv_displs[peer]:recv_displs[peer] + count] = padded_recv[peer * chunk:peer * chunk + count]


def alltoall_v_inplace(tensor: torch.Tensor, counts, displs, comm=None) -> None:
    """:func:`alltoall_v` with ``tensor`` as both the send and the receive
    tensor, and the same counts and displacements for both."""
    if _not_member(comm):
        return
    check_tensor(tensor, "tensor")
    alltoall_v(tensor.clone(), counts, displs, tensor, counts, displs, comm)


def _check_rooted_inplace(what: str, tensor, count: int, root_name: str, root: int, communicator) -> bool:
    """Checks the tensor of an in-place gather or scatter (``nranks * count``
    elements on the root, ``count`` elsewhere); returns whether this rank is
    the root."""
    check_tensor(tensor, "tensor")
    if communicator.rank == root:
        if tensor.numel() != communicator.size * count:
            raise InvalidArgumentError(
                f"{what}: on rank {root_name} the tensor must have nranks * count = "
                f"{communicator.size * count} elements, got {tensor.numel()}")
        return True
    if tensor.numel() != count:
        raise InvalidArgumentError(f"{what}: the tensor must have count = {count} elements, "
                                   f"got {tensor.numel()}")
    return False


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm=None) -> None:
    """The in-place :func:`gather`: on rank ``dst`` ``tensor`` holds
    ``nranks * count`` elements, its own ``count`` already at chunk ``dst``,
    and receives every other rank's ``count`` elements at that rank's chunk;
    on the other ranks ``tensor`` holds the ``count`` elements sent."""
    if _not_member(comm):
        return
    communicator = _communicator(comm)
    count = int(count)
    if _check_rooted_inplace("gather_inplace", tensor, count, "dst", dst, communicator):
        part = tensor.view(-1)[dst * count:(dst + 1) * count].clone()
        _primitives.gather(part, tensor, dst, comm=communicator)
    else:
        _primitives.gather(tensor, tensor, dst, comm=communicator)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm=None) -> None:
    """The in-place :func:`scatter`: on rank ``src`` ``tensor`` holds
    ``nranks * count`` elements (its own chunk ``src`` stays in place); every
    other rank receives its chunk into its ``tensor`` of ``count`` elements."""
    if _not_member(comm):
        return
    communicator = _communicator(comm)
    count = int(count)
    if _check_rooted_inplace("scatter_inplace", tensor, count, "src", src, communicator):
        mine = torch.empty(count, dtype=tensor.dtype, device=tensor.device)
        _primitives.scatter(tensor, mine, src, comm=communicator)
    else:
        _primitives.scatter(tensor, tensor, src, comm=communicator)


def _coalesced(tensors: Sequence[torch.Tensor], what: str, run) -> None:
    """Runs ``run(flat)`` once per (dtype, device) on the tensors flattened,
    then copies the result back into them."""
    from bagua.torch_api.utils import flatten, unflatten

    groups = {}
    for i, tensor in enumerate(tensors):
        check_tensor(tensor, f"{what}[{i}]")
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for members in groups.values():
        flat = flatten(members)
        run(flat)
        with torch.no_grad():
            for tensor, synced in zip(members, unflatten(flat, members)):
                tensor.copy_(synced)


def allreduce_coalesced_inplace(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, comm=None) -> None:
    """:func:`allreduce_inplace` on each tensor, as one message per dtype."""
    if _not_member(comm):
        return
    communicator = _communicator(comm)
    _coalesced(tensors, "tensors", lambda flat: _primitives.allreduce_inplace(flat, op, comm=communicator))


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, comm=None) -> None:
    """:func:`broadcast` of each tensor from rank ``src``, as one message per dtype."""
    if _not_member(comm):
        return
    communicator = _communicator(comm)
    _coalesced(tensors, "tensors", lambda flat: _primitives.broadcast(flat, src, comm=communicator))


def broadcast_object(obj: object, src: int = 0, comm=None) -> object:
    """Rank ``src``'s ``obj`` on every rank (pickled, then two broadcasts:
    its length and its bytes), e.g. ``optimizer.state_dict()``. ``src`` is a
    rank of ``comm``'s group."""
    if _not_member(comm):
        return obj
    communicator = _communicator(comm)
    device = _control_device(communicator)
    if communicator.rank == src:
        buffer = io.BytesIO()
        _pickler.dump(obj, buffer)
        data = torch.tensor(bytearray(buffer.getvalue()), dtype=torch.uint8, device=device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    _primitives.broadcast(length, src, comm=communicator)
    if communicator.rank != src:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if data.numel() > 0:
        _primitives.broadcast(data, src, comm=communicator)
    if communicator.rank == src:
        return obj
    return _pickler.loads(data.cpu().numpy().tobytes())


# -- groups and backends ---------------------------------------------------------
def _torch_group_ranks(group) -> List[int]:
    """The global ranks of a torch.distributed group this rank belongs to;
    [] when it does not belong to it."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return []
    if hasattr(dist, "get_process_group_ranks"):
        return list(dist.get_process_group_ranks(group))
    return sorted(dist.distributed_c10d._pg_group_ranks[group].keys())


def from_torch_group(group, stream: Optional["torch.cuda.Stream"] = None) -> Optional[BaguaProcessGroup]:
    """The bagua group of the ranks of ``group``, a ``torch.distributed``
    process group (``None``: torch's default group).

    Collective over bagua's default group, like :func:`new_group`: every rank
    calls it, a rank outside ``group`` with the ``NON_GROUP_MEMBER`` marker
    ``torch.distributed.new_group`` gave it (it gets ``None`` back). Ranks
    may pass different groups as long as those do not overlap (e.g. each rank
    its own half); each rank gets the group it is in. ``stream`` is accepted
    for Bagua's signature; bagua's communicators use their own streams.
    """
    default = _get_default_group()
    size = default.get_size()
    device = _control_device(default.get_global_communicator())
    mask = torch.zeros(size, dtype=torch.uint8)
    mask[_torch_group_ranks(group)] = 1
    masks = torch.empty(size * size, dtype=torch.uint8, device=device)
    _primitives.allgather(mask.to(device), masks, comm=default)
    rows = masks.cpu().view(size, size).tolist()
    groups = sorted({tuple(r for r in range(size) if row[r]) for row in rows} - {()})
    members = [r for g in groups for r in g]
    if len(members) != len(set(members)):
        raise InvalidArgumentError(f"from_torch_group: the ranks passed overlapping groups {groups}")
    mine = None
    for ranks in groups:  # every rank creates every group, in the same order
        created = new_group(list(ranks))
        if default.get_rank() in ranks:
            mine = created
    return mine


# -- torch's process groups, patched as in Bagua ----------------------------------
# Each torch group patched so far (``bagua_patch``) -> its bagua group. Bagua's
# users and tests read it; destroying a torch group removes its entry.
_torch_to_bagua_pg_map: Dict[object, BaguaProcessGroup] = {}
# Times every torch group was destroyed at once: torch then numbers new groups
# from 1 again, and their rendezvous keys must not meet the old groups' keys.
_torch_group_generation = 0


def _members_group(torch_group) -> BaguaProcessGroup:
    """A bagua group of ``torch_group``'s ranks, connected by those ranks
    alone (the others hold no torch group to patch) through torch's store,
    under the name torch gave the group (the same on every member)."""
    ranks = _torch_group_ranks(torch_group)
    rank = dist.get_rank()
    if rank not in ranks:
        raise InvalidArgumentError(f"bagua_patch: rank {rank} is not a member of the torch group of ranks {ranks}")
    name = dist.distributed_c10d._pg_names[torch_group]
    store = dist.distributed_c10d._get_default_store()
    prefix = f"bagua/torch_group/{_torch_group_generation}/{name}"
    communicator = _process_group_module._connect(store, prefix, ranks.index(rank), len(ranks))
    return BaguaProcessGroup(ranks, communicator, f"torch_group_{name}")


def _bagua_patch(self, stream: Optional["torch.cuda.Stream"] = None):
    """Bagua's ``torch_group.bagua_patch()``: gives this ``torch.distributed``
    process group a bagua group of its ranks (``self.bagua_pg``), created
    on the first call. Collective over the group's members only, as any
    collective of the group; returns the group. ``stream`` is accepted for
    Bagua's signature."""
    if self not in _torch_to_bagua_pg_map:
        _torch_to_bagua_pg_map[self] = _members_group(self)
    return self


def _bagua_pg(self) -> BaguaProcessGroup:
    if self not in _torch_to_bagua_pg_map:
        raise AttributeError("this torch process group has no bagua group yet: call its bagua_patch() first")
    return _torch_to_bagua_pg_map[self]


def _forget_destroyed_torch_groups(group) -> None:
    """After ``torch.distributed.destroy_process_group(group)``: the bagua
    groups of the torch groups it destroyed are let go."""
    global _torch_group_generation
    if dist.is_initialized() and group is not None:
        _torch_to_bagua_pg_map.pop(group, None)
        return
    _torch_to_bagua_pg_map.clear()
    _torch_group_generation += 1


def _install_torch_group_patch() -> None:
    """Adds ``bagua_patch``, ``bagua_pg`` and ``bagua_get_global_communicator``
    to torch's ProcessGroup, and has ``destroy_process_group`` forget the
    groups it destroys (Bagua patched torch the same way)."""
    cls = dist.ProcessGroup
    if getattr(cls, "bagua_patch", None) is _bagua_patch:
        return  # installed already
    cls.bagua_patch = _bagua_patch
    cls.bagua_pg = property(_bagua_pg, doc="The bagua group given by bagua_patch().")
    cls.bagua_get_global_communicator = lambda self: _bagua_pg(self).get_global_communicator()
    native_destroy = dist.distributed_c10d.destroy_process_group

    @functools.wraps(native_destroy)
    def destroy_process_group(group=None):
        native_destroy(group)
        _forget_destroyed_torch_groups(group)

    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = destroy_process_group


class _NamedBackend(core.Backend):
    """A runtime backend with the model name it was asked for."""

    def __init__(self, model_name: str, rank: int):
        super().__init__(rank, timeline=timeline.get(rank))
        self.model_name = model_name


def init_bagua_communicator(model_name: str, stream=None, leader_name: str = "") -> core.Communicator:
    """Bagua 0.8's way to a communicator of all ranks for one model: a new
    group of every rank (collective: every rank must call it), its
    communicator returned. ``model_name``, ``stream`` and ``leader_name`` are
    accepted for the signature (the group's collectives are ordered on its
    own stream)."""
    del model_name, stream, leader_name  # accepted for Bagua's signature
    return new_group(list(range(_get_default_group().get_size()))).get_global_communicator()


_named_backends = {}


def get_backend(model_name: str) -> core.Backend:
    """The runtime backend (``bagua_core.Backend``: the ordered buckets and
    the communication thread) of the model called ``model_name``, created on
    first call and the same object afterwards; ``backend.model_name`` is the
    name. Tensors made with ``ensure_bagua_tensor(name, model_name)`` mark
    themselves ready on it."""
    if model_name not in _named_backends:
        _named_backends[model_name] = _NamedBackend(
            model_name, env.get_rank() if not _primitives.is_initialized() else _get_default_group().get_rank())
    return _named_backends[model_name]


def existing_backend(model_name: str) -> Optional[core.Backend]:
    """``get_backend(model_name)`` if it was called, else None."""
    return _named_backends.get(model_name)


# -- Bagua's communicator methods ---------------------------------------------------
class _Rank(int):
    """A communicator's rank: an int, also callable as Bagua's ``comm.rank()``."""

    def __call__(self) -> int:
        return int(self)


def _torch_tensor(tensor, what: str = "tensor") -> torch.Tensor:
    """A torch tensor from what Bagua's communicator methods take: a tensor,
    or a BaguaTensor (its current value)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    getter = getattr(tensor, "bagua_getter_closure", None)
    if callable(getter):
        return getter()
    raise InvalidArgumentError(f"{what} must be a torch.Tensor or a BaguaTensor, got {type(tensor).__name__}")


def _install_communicator_methods() -> None:
    cls = core.Communicator
    native_rank = cls.rank
    if isinstance(native_rank, property) and not getattr(native_rank.fget, "_bagua_callable", False):
        def rank(self):
            return _Rank(native_rank.fget(self))
        rank._bagua_callable = True
        cls.rank = property(rank, doc="This rank in the group (an int; ``comm.rank()`` works too).")

    def nranks(self) -> int:
        """The number of ranks in the group."""
        return self.size

    def allreduce_inplace(self, tensor, op=ReduceOp.SUM) -> None:
        if isinstance(tensor, core.TensorView):  # a view: straight to the communicator
            op_name = _primitives._op_name(op)
            _primitives._unless_aborted(self, lambda: self.allreduce(tensor, tensor, op_name))
            return
        _primitives.allreduce_inplace(_torch_tensor(tensor), op, comm=self)

    def reduce_inplace(self, tensor, dst: int, op=ReduceOp.SUM) -> None:
        _primitives.reduce_inplace(_torch_tensor(tensor), dst, op, comm=self)

    def allgather_inplace(self, tensor) -> None:
        _primitives.allgather_inplace(_torch_tensor(tensor), comm=self)

    def reduce_scatter_inplace(self, tensor, op=ReduceOp.SUM) -> None:
        _primitives.reduce_scatter_inplace(_torch_tensor(tensor), op, comm=self)

    def alltoall_inplace(self, tensor) -> None:
        _primitives.alltoall_inplace(_torch_tensor(tensor), comm=self)

    def comm_gather_inplace(self, tensor, count: int, dst: int) -> None:
        gather_inplace(_torch_tensor(tensor), count, dst, comm=self)

    def comm_scatter_inplace(self, tensor, count: int, src: int) -> None:
        scatter_inplace(_torch_tensor(tensor), count, src, comm=self)

    def comm_alltoall_v(self, send_tensor, send_counts, send_displs, recv_tensor, recv_counts,
                        recv_displs) -> None:
        alltoall_v(_torch_tensor(send_tensor, "send_tensor"), send_counts, send_displs,
                   _torch_tensor(recv_tensor, "recv_tensor"), recv_counts, recv_displs, comm=self)

    def comm_alltoall_v_inplace(self, tensor, counts, displs) -> None:
        alltoall_v_inplace(_torch_tensor(tensor), counts, displs, comm=self)

    methods = {
        "nranks": nranks, "allreduce_inplace": allreduce_inplace, "reduce_inplace": reduce_inplace,
        "allgather_inplace": allgather_inplace, "reduce_scatter_inplace": reduce_scatter_inplace,
        "alltoall_inplace": alltoall_inplace, "gather_inplace": comm_gather_inplace,
        "scatter_inplace": comm_scatter_inplace, "alltoall_v": comm_alltoall_v,
        "alltoall_v_inplace": comm_alltoall_v_inplace,
    }
    for name, method in methods.items():
        if not hasattr(cls, name):  # the runtime's own method, where it has one, wins
            method.__name__ = name
            setattr(cls, name, method)


def _install_abort() -> None:
    """Bagua's ``comm.abort()`` and ``comm.check_abort()``: the runtime's
    abort, recorded first, so that the communicator counts as cancelled
    rather than failed (see :mod:`._primitives`)."""
    cls = core.Communicator
    if getattr(cls.abort, "_bagua_records", False):
        return  # installed already
    native_abort = cls.abort

    def abort(self) -> None:
        """Cancels this communicator for good, as Bagua's abort did: a call
        blocked in it returns, and later calls return at once, without
        communicating. Safe from any thread."""
        _primitives._mark_aborted(self)
        native_abort(self)

    def check_abort(self) -> bool:
        """Whether ``abort()`` was called on this communicator."""
        return _primitives._was_aborted(self)

    abort._bagua_records = True
    cls.abort = abort
    cls.check_abort = check_abort


_install_communicator_methods()
_install_abort()
_install_torch_group_patch()
