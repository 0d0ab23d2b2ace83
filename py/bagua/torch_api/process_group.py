"""Process groups: which ranks communicate together, and how they connect.

``init_process_group`` connects every rank through PyTorch's own c10d store
(the one ``torchrun`` sets up), so bagua and ``torch.distributed`` can be used
side by side. Each process group owns two communicators: one for the calls
made from the training thread (the primitives of
:mod:`bagua.torch_api.communication`), one for the buckets' ops on the
communication thread, so the two never interleave on one connection.

Bagua's users import these names from ``bagua.torch_api`` or
``bagua.torch_api.communication``; both re-export them from here.
"""

import ipaddress
import os
import socket
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import List, Optional, Sequence

import torch.distributed as dist

from bagua.torch_api import _exit, env
from bagua.torch_api._core import InvalidArgumentError, core, log, thread_setting

__all__ = [
    "BaguaProcessGroup", "init_process_group", "is_initialized", "new_group",
    "get_rank", "get_world_size", "get_local_rank", "get_local_size",
]


class _NonCommMember:
    """What a rank outside a group holds instead of its communicator."""

    def __repr__(self) -> str:
        return "CommMember.NON_COMM_MEMBER"


NON_COMM_MEMBER = _NonCommMember()


class BaguaProcessGroup:
    """A set of ranks that communicate together.

    ``ranks`` are global ranks in increasing order; this process's rank in the
    group is ``get_rank()``. Created by :func:`init_process_group` (all ranks)
    and :func:`new_group`. A rank outside ``ranks`` holds the group too (as in
    Bagua; ``_rank_not_in_group(group)`` says so, ``get_rank()`` is -1), but
    communicating on it is an error.
    """

    def __init__(self, ranks: Sequence[int], communicator, group_name: str):
        self.ranks = list(ranks)
        self.group_name = group_name
        self._communicator = communicator
        self._bucket_communicator = None
        self._hierarchy = None
        self._lock = threading.Lock()
        # Engine groups released by removed engines, by creation number (see
        # engine_group): connecting a new one costs a rendezvous.
        self._free_engine_groups: List["EngineGroup"] = []
        self._engine_groups_made = 0

    def get_rank(self) -> int:
        return self._communicator.rank if self._communicator is not None else -1

    def get_size(self) -> int:
        return len(self.ranks)

    def is_member(self) -> bool:
        """Whether this process is one of the group's ranks."""
        return self._communicator is not None

    def get_global_communicator(self):
        """The communicator of calls made from the training thread; on a rank
        outside the group, Bagua's ``NON_COMM_MEMBER``, with which every
        primitive does nothing."""
        if self._communicator is None:
            return NON_COMM_MEMBER
        return self._communicator

    def _member_communicator(self):
        """The communicator, for what only the group's members can build."""
        if self._communicator is None:
            raise RuntimeError(
                f"rank {get_rank()} is not a member of process group {self.group_name} (ranks "
                f"{self.ranks}): only its members can communicate on it")
        return self._communicator

    def get_bucket_communicator(self):
        """The communicator the buckets' ops use on the communication thread.
        Created on first use: collective, every rank of the group must reach it
        (they do, since every rank builds the same buckets)."""
        with self._lock:
            if self._bucket_communicator is None:
                # On NCCL its collectives share the communication stream with
                # the ops' kernels and the ready-event waits.
                self._bucket_communicator = self._member_communicator().new_bucket_group(
                    list(range(self.get_size())))
            return self._bucket_communicator

    def new_dedicated_communicator(self):
        """A new communicator over the group, for an op that communicates on a
        thread of its own. Collective."""
        with self._lock:
            return self._member_communicator().new_group(list(range(self.get_size())))

    def spans_nodes_of_several_ranks(self) -> bool:
        """Whether a hierarchy over this group has two levels: several nodes,
        one of them with several of its ranks (nodes from LOCAL_WORLD_SIZE, as
        get_hierarchical_communicators takes them). Otherwise a hierarchical
        reduction is the flat one with extra passes."""
        nodes = self.node_of_each_rank()
        return len(set(nodes)) > 1 and len(nodes) > len(set(nodes))

    def node_of_each_rank(self) -> List[int]:
        """The node of each of the group's ranks: consecutive global ranks form
        a node of LOCAL_WORLD_SIZE ranks."""
        local_size = get_local_size()
        if local_size < 1:
            raise InvalidArgumentError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_size}")
        return [rank // local_size for rank in self.ranks]

    def get_hierarchical_communicators(self):
        """The intra-node / inter-node pair over the bucket communicator, nodes
        taken from LOCAL_WORLD_SIZE (consecutive global ranks form a node)."""
        bucket_comm = self.get_bucket_communicator()
        with self._lock:
            if self._hierarchy is None:
                self._hierarchy = core.hierarchical_comms(bucket_comm, self.node_of_each_rank())
            return self._hierarchy

    def engine_group(self) -> "EngineGroup":
        """The same ranks over connections of their own, for one wrapped
        module (see :class:`EngineGroup`). Collective over the group's
        members. One released by a removed engine is reused, the lowest
        numbered first: every rank wraps and unwraps in the same order, so
        every rank holds the same free ones and takes the same."""
        with self._lock:
            if self._free_engine_groups:
                self._free_engine_groups.sort(key=lambda g: g.number)
                return self._free_engine_groups.pop(0)
            number = self._engine_groups_made
            self._engine_groups_made += 1
        return EngineGroup(self, number)

    def release_engine_group(self, group: "EngineGroup") -> None:
        """``group``'s engine was removed (its communication thread joined):
        the next wrapped module may use its connections."""
        with self._lock:
            if group.parent is self and group not in self._free_engine_groups:
                self._free_engine_groups.append(group)

    def __repr__(self) -> str:
        return f"BaguaProcessGroup({self.group_name}, ranks={self.ranks})"


class EngineGroup(BaguaProcessGroup):
    """A process group's ranks as one wrapped module sees them: the same
    ranks, over communicators of its own.

    Every engine runs its buckets on a communication thread of its own, in
    its own registration order. Two engines sharing one connection would
    issue their collectives on it in whatever order their threads reach it,
    which differs across ranks when two models' backwards overlap (a GAN, a
    teacher and a student, ``loss(A(x) + B(x))``): a hang, or, where two
    buckets have the same size, one rank's A gradient summed with another's B
    gradient and no error at all. So each engine gets its own connections:
    one for the collectives its training thread issues (the initial
    broadcast, bucket checks, the algorithm's agreements) and, on first use,
    one for its buckets' ops. Creating them is collective, in the order the
    ranks wrap their modules: every rank wraps the same modules in the same
    order, as with DDP. A removed engine's group goes back to its parent
    for the next wrapped module (``release_engine_group``).
    """

    def __init__(self, parent: BaguaProcessGroup, number: int):
        communicator = parent._member_communicator().new_group(list(range(parent.get_size())))
        super().__init__(parent.ranks, communicator, parent.group_name)
        self.parent = parent
        self.number = number  # the parent's how-many-th

    def engine_group(self) -> "EngineGroup":
        return self.parent.engine_group()

    def release_engine_group(self, group: "EngineGroup") -> None:
        self.parent.release_engine_group(group)

    def __repr__(self) -> str:
        return f"EngineGroup({self.group_name}, ranks={self.ranks})"


# The engine group whose buckets this thread is building, if any (see
# building_ops_for): an op an algorithm appends with group=None, or with the
# group the engine was made from, runs on the engine's own connections.
_building = threading.local()


@contextmanager
def building_ops_for(engine_group: "EngineGroup"):
    """While an engine builds its buckets' ops on this thread."""
    with thread_setting(_building, "group", engine_group):
        yield


def group_for_ops(group: Optional[BaguaProcessGroup]) -> BaguaProcessGroup:
    """The group a bucket op appended with ``group`` communicates on: the
    engine's own when it stands for the engine's group (None means the
    default group), else ``group`` or the default group."""
    engine = getattr(_building, "group", None)
    wanted = group if group is not None else _get_default_group()
    if isinstance(engine, EngineGroup) and wanted is engine.parent:
        return engine
    return wanted


_default_group: Optional[BaguaProcessGroup] = None
_group_count = 0


def is_initialized() -> bool:
    return _default_group is not None


def _require_init(what: str) -> BaguaProcessGroup:
    if _default_group is None:
        raise RuntimeError(
            f"{what} needs bagua's process group: call bagua.torch_api.init_process_group() first"
        )
    return _default_group


def _get_default_group() -> BaguaProcessGroup:
    return _require_init("this call")


def get_rank() -> int:
    return _default_group.get_rank() if _default_group is not None else env.get_rank()


def get_world_size() -> int:
    return _default_group.get_size() if _default_group is not None else env.get_world_size()


def get_local_rank() -> int:
    return env.get_local_rank()


def get_local_size() -> int:
    return env.get_local_size()


def _gloo_address():
    """(interface, hostname) Gloo should bind: GLOO_SOCKET_IFNAME as torch reads
    it, else loopback on a single machine, else this host's address."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if interface:
        return interface, ""
    hostname = core.env().gloo_hostname
    if hostname:
        return "", hostname
    master = env.get_master_addr()
    if master in ("127.0.0.1", "localhost", "::1") or env.get_local_size() >= env.get_world_size():
        return "", "127.0.0.1"
    return "", socket.gethostbyname(socket.gethostname())


class _Rendezvous:
    """The launcher's rendezvous made by ``init_process_group``: the c10d
    store and, until it succeeds, how to initialize ``torch.distributed`` over
    it. Kept across a failed call: a retry must join the same store, since a
    second rendezvous would start a second TCPStore server on MASTER_PORT and
    the ranks could meet on different ones (each then waits for peers that
    never arrive). ``attempts`` gives each try its own key prefix, so a retry
    never reads what a failed one left in the store."""

    def __init__(self, key, store, init_torch):
        self.key, self.store, self.init_torch = key, store, init_torch
        self.attempts = 0

    def next_prefix(self) -> str:
        self.attempts += 1
        return "bagua" if self.attempts == 1 else f"bagua/retry{self.attempts - 1}"


_pending_rendezvous: Optional[_Rendezvous] = None


def _torch_store(world_size: int) -> _Rendezvous:
    """The c10d store of ``torch.distributed`` and, if nobody initialized
    ``torch.distributed``, a function that does (Gloo, over that store): bagua
    rendezvous through the store the launcher set up.

    The rendezvous and torch's Gloo are bounded by BAGUA_COMM_TIMEOUT_S (not
    torch's 30 minutes), and torch's Gloo connects only after bagua's own
    communicator has, whose rendezvous checks every rank's address first and
    says which variable to set when one advertises loopback to another host.
    """
    global _pending_rendezvous
    if dist.is_initialized():
        return _Rendezvous(None, dist.distributed_c10d._get_default_store(), None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ and world_size > 1:
        raise RuntimeError(
            "init_process_group: MASTER_PORT is not set; launch with "
            "'python -m bagua.distributed.launch' or torchrun"
        )
    os.environ.setdefault("MASTER_PORT", "29500")
    key = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], env.get_rank(), world_size)
    if _pending_rendezvous is not None and _pending_rendezvous.key == key:
        return _pending_rendezvous  # a retry after a failed call
    timeout = timedelta(seconds=core.env().comm_timeout_s)  # raises on a bad value
    # What dist.init_process_group("gloo") does, split in two.
    raw, rank, world_size = _store_rendezvous(env.get_rank(), world_size, timeout)
    raw.set_timeout(timeout)
    # Under torchrun, keys of its own per restart: torch 2.x hands the
    # workers of every restart the agent's one store without the per-attempt
    # prefix torch 1.13 added, and a restarted rank then read its dead peer's
    # address (connect refused, then the restarts ran out).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore("default_pg" if restart == "0" else f"default_pg/restart{restart}", raw)

    def init_torch():
        _check_torch_gloo_address(store, rank, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)

    _pending_rendezvous = _Rendezvous(key, store, init_torch)
    return _pending_rendezvous


def _store_rendezvous(rank: int, world_size: int, timeout: timedelta):
    """torch's env:// rendezvous: rank 0 hosts a TCPStore on MASTER_PORT, the
    others connect to it. A port another program holds is a StoreError on
    rank 0 that names it, and a CommTimeoutError within ``timeout`` on the
    other ranks (see _check_store_answers)."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if rank != 0:
        _check_store_answers(rank, world_size, timeout, where)
    try:
        return next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    except RuntimeError as error:
        if "address already in use" not in str(error).lower():
            raise
        raise core.StoreError(
            f"init_process_group on rank {rank}: MASTER_PORT {os.environ['MASTER_PORT']} is in use by "
            f"another program, so rank 0 cannot host the store at {where}; choose a free port") from error


def _check_store_answers(rank: int, world_size: int, timeout: timedelta, where: str) -> None:
    """Whatever listens at ``where`` answers as a store, within ``timeout``.
    torch's rendezvous client waits for the store's handshake with no limit
    (with another program on MASTER_PORT, torch 1.13 waited until that
    program hung up: 88 s with a 5 s timeout; torch 2.x's client, which checks
    the server when it connects, waited past 60 s with a 3 s timeout). A
    client that does not wait for the workers, one key set and waited for, is
    bounded by the timeout; _StoreConnectionCutter ends a connect that is not."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        with _StoreConnectionCutter(address, port, timeout.total_seconds()):
            probe = dist.TCPStore(address, port, world_size, False, timeout, wait_for_workers=False)
            key = f"bagua/store_answers/{rank}"
            probe.set(key, "1")
            probe.wait([key], timeout)
    except RuntimeError as error:  # torch 2.x's DistNetworkError and DistStoreError are RuntimeErrors
        raise core.CommTimeoutError(
            f"init_process_group on rank {rank}: what listens at {where} (MASTER_ADDR:MASTER_PORT) did not "
            f"answer as rank 0's store within {timeout.total_seconds():g} s (BAGUA_COMM_TIMEOUT_S): rank 0 "
            f"did not start it, or another program holds that port ({_first_line(error)})") from None


def _first_line(error: Exception) -> str:
    """torch 2.x's store errors carry a C++ stack trace after their first line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _StoreConnectionCutter:
    """While the block runs, a thread waits ``seconds``; past them, it shuts
    down this process's TCP connections to ``address:port`` every 0.1 s, so a
    store client blocked on a peer that never answers (torch's waits release
    the GIL) fails with an error instead of waiting on. Only the connections
    to that one address and port are touched, and only after the deadline."""

    def __init__(self, address: str, port: int, seconds: float):
        self.port, self.seconds = port, seconds
        try:
            self.peers = {info[4][0] for info in socket.getaddrinfo(address, port, proto=socket.IPPROTO_TCP)}
        except OSError:
            self.peers = set()  # unresolvable: torch's client fails on its own, at once
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cut_after_deadline, name="bagua-store-cutter", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        return False

    def _cut_after_deadline(self) -> None:
        if self.done.wait(self.seconds):
            return
        while True:
            cut = self._shut_down_connections()
            if cut:
                log("warn", f"the store at {sorted(self.peers)}:{self.port} did not answer within "
                            f"{self.seconds:g} s: closing {cut} connection(s) to it")
            if self.done.wait(0.1):
                return

    def _shut_down_connections(self) -> int:
        cut = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                duplicate = os.dup(int(name))
            except OSError:  # closed since the listing
                continue
            try:
                connection = socket.socket(fileno=duplicate)
            except OSError:  # not a socket
                os.close(duplicate)
                continue
            with connection:
                if connection.family not in (socket.AF_INET, socket.AF_INET6) or connection.type != socket.SOCK_STREAM:
                    continue
                try:
                    peer = connection.getpeername()
                except OSError:  # not connected
                    continue
                host = peer[0].removeprefix("::ffff:")  # torch 2.x connects IPv4 through an IPv6 socket
                if peer[1] == self.port and host in self.peers:
                    connection.shutdown(socket.SHUT_RDWR)
                    cut += 1
        return cut


def _network_identity() -> str:
    """Which loopback interface this process shares with others: the same
    kernel (boot id) and network namespace (as the C++ rendezvous check)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return f"{boot_id}/netns:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return "host:" + socket.gethostname()


def _check_torch_gloo_address(store, rank: int, world_size: int) -> None:
    """torch.distributed's Gloo takes its address from GLOO_SOCKET_IFNAME or
    else from the hostname, loopback when the hostname resolves to 127.0.0.1
    (BAGUA_GLOO_HOSTNAME does not apply to it). Before it connects, the ranks
    compare notes through the store, so that loopback advertised to a rank on
    another host is an error on every rank instead of "Connection refused" on
    one and a hang on the other."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or world_size == 1:
        return
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        address = "127.0.0.1"  # torch falls back to loopback
    loopback = ipaddress.ip_address(address).is_loopback
    store.set(f"bagua/torch_gloo_address/{rank}", f"{_network_identity()}\n{hostname}\n{address}\n{int(loopback)}")
    peers = [store.get(f"bagua/torch_gloo_address/{r}").decode().split("\n") for r in range(world_size)]
    for r, (identity, host, addr, is_loopback) in enumerate(peers):
        if is_loopback != "1":
            continue
        for other, (other_identity, other_host, _, _) in enumerate(peers):
            if other_identity != identity:
                raise InvalidArgumentError(
                    f"torch.distributed's Gloo (initialized by bagua.init_process_group): rank {r} "
                    f"(host {host!r}) would advertise {addr} to its peers, a loopback address (its "
                    f"hostname resolves to it), but rank {other} (host {other_host!r}) is on another "
                    f"host or network namespace and cannot reach it. Set GLOO_SOCKET_IFNAME to the "
                    f"network interface to use (e.g. eth0); BAGUA_GLOO_HOSTNAME applies to bagua's "
                    f"communicator only, or initialize torch.distributed yourself first")


def _check_backend() -> None:
    """Refuses BAGUA_BACKEND=nccl where NCCL cannot run, before any
    rendezvous: every rank fails at once with the reason."""
    if core.env().backend == "nccl":
        reason = core.nccl_unavailable_reason()
        if reason:
            raise RuntimeError(f"BAGUA_BACKEND=nccl but NCCL cannot be used here: {reason}")


def _connect(store, prefix: str, rank: int, world_size: int):
    """The default group's communicator over ``store`` (keys under
    ``prefix``), on BAGUA_BACKEND (the runtime applies BAGUA_COMM_TIMEOUT_S
    itself)."""
    prefixed = core.python_store(dist.PrefixStore(prefix, store))
    if core.env().backend == "nccl":
        return core.nccl_communicator(prefixed, rank, world_size, prefix="default",
                                      device=get_local_rank())
    interface, hostname = _gloo_address()
    return core.gloo_communicator(prefixed, rank, world_size, prefix="default", interface_name=interface,
                                  hostname=hostname)


def init_process_group(store: Optional["dist.Store"] = None, rank: int = -1,
                       world_size: int = -1, local_world_size: int = -1) -> None:
    """Connects this process to the others.

    Reads RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as
    written by ``torchrun`` / ``python -m bagua.distributed.launch``. Also
    initializes ``torch.distributed`` (Gloo) if nobody did, whose store bagua
    shares. Calling it again is a no-op. At exit, what bagua started is
    stopped (see :mod:`bagua.torch_api._exit`).
    """
    global _default_group, _pending_rendezvous
    if _default_group is not None:
        return
    # Explicit arguments win over the launcher's variables (and are written
    # back, so env.* and torch read the same values).
    for name, value, given in (("RANK", rank, rank >= 0), ("WORLD_SIZE", world_size, world_size > 0),
                               ("LOCAL_WORLD_SIZE", local_world_size, local_world_size > 0)):
        if given:
            os.environ[name] = str(value)
    rank, world_size = env.get_rank(), env.get_world_size()
    _check_backend()
    if store is None:
        rendezvous = _torch_store(world_size)
        communicator = _connect(rendezvous.store, rendezvous.next_prefix(), rank, world_size)
        if rendezvous.init_torch is not None:
            rendezvous.init_torch()
        _pending_rendezvous = None
    else:
        communicator = _connect(store, "bagua", rank, world_size)
    _default_group = BaguaProcessGroup(list(range(world_size)), communicator, "default")
    _exit.install(_release_default_group, _StoreConnectionCutter)
    log("info", f"rank {rank} of {world_size} connected ({communicator.backend_name}, "
                f"local size {get_local_size()}, cuda devices {core.cuda_device_count()})")


def _release_default_group() -> None:
    """Forgets the default group (at exit, after the engines stopped)."""
    global _default_group
    _default_group = None


def new_group(ranks: Optional[List[int]] = None) -> BaguaProcessGroup:
    """A process group of ``ranks`` (default: all). Collective: every rank of the
    default group calls it with the same ranks. Non-members get a group too,
    on which :func:`_rank_not_in_group` is True (they must not communicate on it)."""
    global _group_count
    group = _require_init("new_group")
    if ranks is None:
        ranks = list(range(group.get_size()))
    ranks = sorted(int(r) for r in ranks)
    _group_count += 1
    communicator = group.get_global_communicator().new_group(ranks)  # None for non-members
    return BaguaProcessGroup(ranks, communicator, f"group{_group_count}")


def _rank_not_in_group(group: Optional[BaguaProcessGroup]) -> bool:
    """Bagua's check: True when this process is not a member of ``group``
    (None, the default group, is every rank's)."""
    return group is not None and not group.is_member()
