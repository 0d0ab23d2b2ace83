"""The communication primitives on torch tensors, with Bagua's signatures.

Every primitive goes through one funnel, :class:`_Call`: find the
communicator (the group's, or the default group's: ``init_process_group``
must have run), check the tensors and the root rank, check that the ranks
all passed the same sizes and dtypes (one small allgather; disable with
BAGUA_CHECK_COLLECTIVES=0: a mismatch is an ``InvalidArgumentError`` on
every rank, never a hang), pass the tensors as they are where the
communicator reaches their memory (copying them to the host otherwise), and
call the communicator's method of the same name. What is left in each
primitive is what is particular to it.

A communicator the user aborted (Bagua's ``comm.abort()``, see
:func:`_mark_aborted`) is cancelled, as Bagua's NCCL abort cancelled every
operation outstanding on it: a call blocked in it returns, and later calls
return at once, without communicating (their outputs are left as they
were). Errors of a communicator that failed by itself still raise.

The process groups live in :mod:`bagua.torch_api.process_group`; this module
re-exports them, since Bagua's users import both from here. Users import all
of it from :mod:`bagua.torch_api.communication`, which adds the rest of
Bagua's module (:mod:`._compat_communication`, built on this one).
"""

import contextlib
import enum
import functools
import threading
import weakref
from typing import Optional

import torch

from bagua.torch_api._core import (
    BaguaError,
    InvalidArgumentError,
    check_tensor,
    core,
    device_name,
    dtype_name,
    tensor_view,
    thread_setting,
)
# The group API, re-exported: Bagua's users import it from here.
from bagua.torch_api import process_group as _process_group
from bagua.torch_api.process_group import *  # noqa: F401,F403
from bagua.torch_api.process_group import BaguaProcessGroup, _get_default_group, _rank_not_in_group, _require_init  # noqa: F401,E501

__all__ = _process_group.__all__ + [
    "ReduceOp", "allreduce", "allreduce_inplace", "reduce", "reduce_inplace", "broadcast",
    "allgather", "allgather_inplace", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_inplace", "alltoall", "alltoall_inplace", "send", "recv", "barrier",
    "partial_allreduce", "partial_allreduce_inplace", "low_precision_average_inplace",
]


class ReduceOp(enum.IntEnum):
    """Reduction operators, with Bagua's values."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}


def _op_name(op) -> str:
    try:
        return _OP_NAMES[ReduceOp(op)]
    except (ValueError, KeyError):
        raise InvalidArgumentError(
            f"reduce op {op!r} is not supported; use ReduceOp.SUM, AVG, MIN, MAX or PRODUCT"
        ) from None


class _NotAMember(Exception):
    """Raised by _resolve for a group this rank is not in: the primitive
    returns without doing anything (Bagua's semantics for NON_COMM_MEMBER)."""


def _resolve(comm) -> "core.Communicator":
    if comm is _process_group.NON_COMM_MEMBER:
        raise _NotAMember()
    if comm is None:
        return _require_init("communication").get_global_communicator()
    if isinstance(comm, BaguaProcessGroup):
        if not comm.is_member():
            raise _NotAMember()
        return comm.get_global_communicator()
    if isinstance(comm, core.Communicator):
        return comm
    raise InvalidArgumentError(f"comm must be a BaguaProcessGroup or None, got {type(comm).__name__}")


_known_to_match = threading.local()


@contextlib.contextmanager
def calls_known_to_match():
    """Marks the collectives issued inside, on this thread, as calls that
    match across ranks by construction, so the cross-rank check of sizes (a
    round trip, as costly as a small allreduce) is skipped. A bucket's
    Python op runs in it (``BaguaBucket.append_python_op``): every rank runs
    the same ops in the same bucket order."""
    with thread_setting(_known_to_match, "active", True):
        yield


def _checks_enabled() -> bool:
    return bool(core.env().check_collectives) and not getattr(_known_to_match, "active", False)


# The _Call of the collective running on this thread (see _agreed).
_current = threading.local()

# Communicators aborted by the user (the communicator objects are shared
# by their group and its users, so the mark lives as long as they do).
_aborted = weakref.WeakSet()


def _mark_aborted(communicator) -> None:
    """Records that the user is aborting ``communicator`` (Bagua's
    ``comm.abort()``, installed by :mod:`._compat_communication`), before the
    runtime's abort runs: the call it interrupts then fails with the
    communicator's error, which :func:`_unless_aborted` turns into a return."""
    _aborted.add(communicator)


def _was_aborted(communicator) -> bool:
    return communicator in _aborted


def _unless_aborted(communicator, run) -> bool:
    """Runs ``run()`` on ``communicator`` unless the user aborted it, before
    or during the call. Returns whether ``run`` completed."""
    if _was_aborted(communicator):
        return False
    try:
        run()
    except BaguaError:
        if _was_aborted(communicator):  # interrupted by abort(): cancelled, not failed
            return False
        raise
    return True


def _agreed(primitive):
    """For a collective that compares its calls across ranks: an argument
    error this rank finds before the comparison is shared with the other
    ranks through it, and every rank raises it. Otherwise the others would
    wait in a collective this rank never joins (a root-only check, a tensor
    that differs on one rank). Not where the comparison is off
    (BAGUA_CHECK_COLLECTIVES=0): then the error stays on this rank."""

    @functools.wraps(primitive)
    def agreed(*args, **kwargs):
        outer = getattr(_current, "call", None)
        _current.call = None
        try:
            return primitive(*args, **kwargs)
        except _NotAMember:
            return None
        except InvalidArgumentError as error:
            call = _current.call
            if getattr(error, "shared", False) or call is None or call.compared or call.size <= 1 \
                    or not _checks_enabled() or _was_aborted(call.comm):  # no peers left to tell
                raise
            call.refuse(str(error))
        finally:
            _current.call = outer

    return agreed


def _members_only(primitive):
    """A primitive called with a group this rank is not in does nothing."""

    @functools.wraps(primitive)
    def members_only(*args, **kwargs):
        try:
            return primitive(*args, **kwargs)
        except _NotAMember:
            return None

    return members_only


class _Call:
    """One call of a primitive ``op``: the part every primitive shares.

    Constructing it resolves the communicator and checks the named tensors
    (keyword arguments, so errors name them as the user's signature does);
    the ``check_*`` methods are the preconditions primitives have in common;
    :meth:`run` verifies the call across ranks and runs
    ``communicator.<op>(views..., *args)``.
    """

    def __init__(self, op: str, comm, **tensors):
        self.op = op
        self.comm = _resolve(comm)
        self.compared = False  # whether the ranks compared this call yet
        _current.call = self
        for name, tensor in tensors.items():
            check_tensor(tensor, name)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def check_root(self, what: str, root) -> int:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidArgumentError(f"{self.op}: {what} {root!r} is not a rank of a group of size {self.size}")
        return root

    def check_same_size(self, send_tensor, recv_tensor) -> None:
        if send_tensor.numel() != recv_tensor.numel() or send_tensor.dtype != recv_tensor.dtype:
            raise InvalidArgumentError(
                f"{self.op}: send_tensor {send_tensor.dtype}{list(send_tensor.shape)} and recv_tensor "
                f"{recv_tensor.dtype}{list(recv_tensor.shape)} differ in size or dtype")

    def check_gathered(self, part, whole, on_rank: Optional[int] = None) -> None:
        """``whole`` holds one ``part`` per rank (checked only on rank
        ``on_rank`` when given: the root, the only rank that uses ``whole``)."""
        if on_rank is not None and self.rank != on_rank:
            return
        if whole.numel() != part.numel() * self.size or whole.dtype != part.dtype:
            raise InvalidArgumentError(
                f"{self.op}: expected a tensor of {self.size} x {part.numel()} {part.dtype} elements, got "
                f"{whole.dtype}{list(whole.shape)}")

    def check_chunks(self, tensor) -> int:
        """The size of each rank's chunk of ``tensor``."""
        if tensor.numel() % self.size != 0:
            raise InvalidArgumentError(
                f"{self.op}: {tensor.numel()} elements do not split into {self.size} equal chunks")
        return tensor.numel() // self.size

    def own_chunk(self, tensor):
        """This rank's chunk of ``tensor`` (chunk ``rank``), a view."""
        chunk = self.check_chunks(tensor)
        return tensor.view(-1)[self.rank * chunk:(self.rank + 1) * chunk]

    def run(self, inputs, outputs, *args, verify=None, root: int = -1) -> None:
        """Runs the op on ``inputs`` then ``outputs`` (views, in that order)
        and ``args``; first, unless ``verify`` is None, every rank checks that
        all passed a tensor of ``verify``'s size and dtype (and ``root``).
        On an aborted communicator nothing runs and the outputs are left."""
        self.compared = True
        tensors = list(inputs) + list(outputs)
        reached = {id(t): _reachable(self.comm, t) for t in tensors}

        def communicate():
            if verify is not None and _checks_enabled() and self.size > 1:
                # A view of no memory: only its size and dtype are compared.
                shape = core.TensorView(0, verify.numel(), dtype_name(verify.dtype), "cpu")
                self.comm.verify_same_call(self.op, shape, root)
            getattr(self.comm, self.op)(*[tensor_view(reached[id(t)], allow_cuda=True) for t in tensors], *args)

        if not _unless_aborted(self.comm, communicate):
            return
        for t in outputs:
            if reached[id(t)] is not t:
                t.copy_(reached[id(t)])

    def refuse(self, reason: str) -> None:
        """Takes part in the ranks' comparison of this call with ``reason``
        for refusing it: every rank raises the refusals (InvalidArgumentError)."""
        self.compared = True
        try:
            self.comm.verify_same_call(self.op, core.TensorView(0, 0, "uint8", "cpu"), -1, reason)
        except InvalidArgumentError as shared:
            shared.shared = True
            raise shared from None
        raise AssertionError("verify_same_call accepted a refused call")


def _reachable(comm, tensor):
    """``tensor`` itself where ``comm`` reaches its memory (``supports``: NCCL,
    and Gloo in a CUDA build, which stages through pinned host memory in C++),
    once the kernels producing it have finished; else a host copy (a CUDA
    tensor with bagua built without CUDA), copied back after the call."""
    if not comm.supports(device_name(tensor.device)):
        return tensor.detach().to("cpu")
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return tensor


@_agreed
def allreduce(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor = op over ranks of send_tensor."""
    call = _Call("allreduce", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_same_size(send_tensor, recv_tensor)
    call.run([send_tensor], [recv_tensor], _op_name(op), verify=send_tensor)


@_agreed
def allreduce_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    allreduce(tensor, tensor, op, comm)


@_agreed
def low_precision_average_inplace(tensor, comm=None) -> None:
    """Averages ``tensor`` over all ranks with MinMaxUInt8 codes on the wire
    (about a quarter of the bytes of ``allreduce``): a scatter of 8-bit
    chunks, each chunk's owner averages it, a gather of the 8-bit averages
    (docs/compression.md). Every rank ends with the same values, within the
    8-bit error of the exact average. Float32 host memory is used as is;
    other tensors go through a float32 host copy."""
    call = _Call("low_precision_average", comm, tensor=tensor)
    if call.size == 1:
        return
    call.compared = True
    if _checks_enabled():
        call.comm.verify_same_call(call.op, core.TensorView(0, tensor.numel(), "float32", "cpu"), -1)
    members = list(range(call.size))
    work = tensor if tensor.dtype == torch.float32 and tensor.device.type == "cpu" \
        else tensor.detach().to("cpu", torch.float32)
    core.low_precision_partial_allreduce(call.comm, tensor_view(work), members,
                                         call.comm.next_partial_id(members))
    if work is not tensor:
        tensor.copy_(work)


@_agreed
def reduce(send_tensor, recv_tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor on rank ``dst`` = op over ranks of send_tensor."""
    call = _Call("reduce", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_root("dst", dst)
    call.check_same_size(send_tensor, recv_tensor)
    call.run([send_tensor], [recv_tensor], dst, _op_name(op), verify=send_tensor, root=dst)


@_agreed
def reduce_inplace(tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
    reduce(tensor, tensor, dst, op, comm)


@_agreed
def broadcast(tensor, src: int = 0, comm=None) -> None:
    """tensor on every rank = tensor on rank ``src``."""
    call = _Call("broadcast", comm, tensor=tensor)
    call.check_root("src", src)
    # In place: the tensor is both what rank src sends and what the others receive.
    call.run([], [tensor], src, verify=tensor, root=src)


@_agreed
def allgather(send_tensor, recv_tensor, comm=None) -> None:
    """recv_tensor = concatenation over ranks of send_tensor."""
    call = _Call("allgather", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_gathered(send_tensor, recv_tensor)
    call.run([send_tensor], [recv_tensor], verify=send_tensor)


@_agreed
def allgather_inplace(tensor, comm=None) -> None:
    """Each rank's chunk of ``tensor`` (chunk ``rank``) is gathered to all."""
    call = _Call("allgather_inplace", comm, tensor=tensor)
    allgather(call.own_chunk(tensor).clone(), tensor, comm)


@_agreed
def gather(send_tensor, recv_tensor, dst: int, comm=None) -> None:
    """recv_tensor on rank ``dst`` = concatenation over ranks of send_tensor."""
    call = _Call("gather", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_root("dst", dst)
    call.check_gathered(send_tensor, recv_tensor, on_rank=dst)
    call.run([send_tensor], [recv_tensor], dst, verify=send_tensor, root=dst)


@_agreed
def scatter(send_tensor, recv_tensor, src: int, comm=None) -> None:
    """recv_tensor on rank r = chunk r of send_tensor on rank ``src``."""
    call = _Call("scatter", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_root("src", src)
    call.check_gathered(recv_tensor, send_tensor, on_rank=src)
    call.run([send_tensor], [recv_tensor], src, verify=recv_tensor, root=src)


@_agreed
def reduce_scatter(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor on rank r = op over ranks of chunk r of send_tensor."""
    call = _Call("reduce_scatter", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_gathered(recv_tensor, send_tensor)
    call.run([send_tensor], [recv_tensor], _op_name(op), verify=send_tensor)


@_agreed
def reduce_scatter_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    """Chunk ``rank`` of ``tensor`` becomes the reduction of that chunk over ranks."""
    call = _Call("reduce_scatter_inplace", comm, tensor=tensor)
    mine = call.own_chunk(tensor)
    out = torch.empty_like(mine)
    reduce_scatter(tensor, out, op, comm)
    mine.copy_(out)


@_agreed
def alltoall(send_tensor, recv_tensor, comm=None) -> None:
    """Chunk j of recv_tensor on rank i = chunk i of send_tensor on rank j."""
    call = _Call("alltoall", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_same_size(send_tensor, recv_tensor)
    call.check_chunks(send_tensor)
    call.run([send_tensor], [recv_tensor], verify=send_tensor)


@_agreed
def alltoall_inplace(tensor, comm=None) -> None:
    out = torch.empty_like(tensor)
    alltoall(tensor, out, comm)
    tensor.copy_(out)


@_members_only
def send(tensor, dst: int, comm=None) -> None:
    """Sends ``tensor`` to rank ``dst``, which must post a matching :func:`recv`."""
    call = _Call("send", comm, tensor=tensor)
    call.check_root("dst", dst)
    call.run([tensor], [], dst)


@_members_only
def recv(tensor, src: int, comm=None) -> None:
    """Receives into ``tensor`` what rank ``src`` sends."""
    call = _Call("recv", comm, tensor=tensor)
    call.check_root("src", src)
    call.run([], [tensor], src)


@_members_only
def barrier(comm=None) -> None:
    _resolve(comm).barrier()


def _member_list(op: str, ranks, rank: int, size: int) -> list:
    """``ranks`` checked and sorted: distinct ints of the group, the caller among them."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise InvalidArgumentError(f"{op}: ranks must be a list of ints, got {ranks!r}")
    members = list(ranks)
    if not members:
        raise InvalidArgumentError(f"{op}: ranks is empty")
    for r in members:
        if isinstance(r, bool) or not isinstance(r, int):
            raise InvalidArgumentError(f"{op}: ranks must be ints, got {r!r} in {members}")
        if not 0 <= r < size:
            raise InvalidArgumentError(f"{op}: rank {r} in ranks {members} is not a rank of a group of size {size}")
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"{op}: ranks {members} holds duplicates")
    if rank not in members:
        raise InvalidArgumentError(f"{op}: the calling rank {rank} is not in ranks {members}; only members call it")
    return sorted(members)


@_members_only
def partial_allreduce(send_tensor, recv_tensor, ranks, op=ReduceOp.AVG, comm=None, group_id=None) -> None:
    """recv_tensor on every rank of ``ranks`` = op over those ranks' send_tensor (P-Reduce).

    Only the ranks in ``ranks`` call it; the others are not involved, and
    calls of disjoint groups run at the same time. The traffic is
    point-to-point among the members on the group's existing connections:
    no communicator is created. Members sharing several groups must call them
    in the same relative order; members that disagree about the group get a
    ``CommTimeoutError`` naming it, never mixed data. ``group_id``: an id all
    members pass alike (a group generator's); by default the number of
    earlier calls with the same member set. With BAGUA_CHECK_COLLECTIVES=1 the
    members first compare sizes, dtypes and op among themselves.
    """
    call = _Call("partial_allreduce", comm, send_tensor=send_tensor, recv_tensor=recv_tensor)
    call.check_same_size(send_tensor, recv_tensor)
    members = _member_list("partial_allreduce", ranks, call.rank, call.size)
    if group_id is None:
        group_id = call.comm.next_partial_id(members)
    elif isinstance(group_id, bool) or not isinstance(group_id, int) or group_id < 0:
        raise InvalidArgumentError(f"partial_allreduce: group_id must be an int >= 0, got {group_id!r}")
    verify = _checks_enabled() and len(members) > 1
    call.run([send_tensor], [recv_tensor], members, _op_name(op), group_id, verify)


@_members_only
def partial_allreduce_inplace(tensor, ranks, op=ReduceOp.AVG, comm=None, group_id=None) -> None:
    partial_allreduce(tensor, tensor, ranks, op, comm, group_id)

