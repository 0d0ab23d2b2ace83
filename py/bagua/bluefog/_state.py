"""``bf.init``, the process queries and the topology of ``bagua.bluefog``.

BlueFog's state lives on bagua's default process group (``bf.init`` creates it
when the script did not), plus communicators of its own: the neighbour ops and
BlueFog's collectives never share a connection with the buckets of a
``with_bagua`` model in the same script. Every BlueFog call runs on one worker
thread (``_fusion.Worker``), so those communicators are used by one thread at
a time.
"""

import hashlib
import os
from typing import List, Optional

import networkx as nx
import numpy as np
import torch

import bagua.torch_api as bagua
from bagua.bluefog import _fusion, _timeline, topology_util
from bagua.torch_api._core import core, log, tensor_view

_NOT_INITIALIZED = "BlueFog has not been initialized; use bf.init()."


class _State:
    """What ``bf.init`` sets up once per process."""

    def __init__(self):
        group = bagua.communication._get_default_group()
        self.comm = group.new_dedicated_communicator()  # collective
        self.neighbor_allreduce = core.NeighborAllreduce(self.comm)
        self.neighbor_allgather = core.NeighborAllgather(self.comm)
        self.local_size = _local_size_from_env(self.comm.size)
        self.local_comm = self._machine_communicator()
        # Local rank 0 of every machine: the ranks of the machine-level step
        # of hierarchical_neighbor_allreduce (None on the other ranks).
        self.leader_comm = self.comm.new_group(list(range(0, self.comm.size, self.local_size)))
        self.leader_neighbor_allreduce = (core.NeighborAllreduce(self.leader_comm)
                                          if self.leader_comm is not None else None)
        self.homogeneous = self.comm.size % self.local_size == 0
        self.topology: Optional[nx.DiGraph] = None
        self.is_weighted = False
        self.machine_topology: Optional[nx.DiGraph] = None
        self.machine_is_weighted = False
        self.skip_negotiate = False
        # One thread runs every BlueFog call in issue order (blocking calls
        # too), so the communicators above see one thread and one order; it
        # fuses pending neighbour allreduces (_fusion).
        self.worker = _fusion.Worker(self.comm, self.neighbor_allreduce,
                                     _agreed_threshold(self.comm), _cycle_time_s())
        self.handles = {}
        self.next_handle = 0
        self.windows = None  # bagua.bluefog._windows, from the first win_create

    def _machine_communicator(self):
        """The communicator of this rank's machine (consecutive ranks,
        local_size per machine). Collective: every rank takes part in every
        machine's group creation."""
        mine = None
        size = self.comm.size
        for first in range(0, size, self.local_size):
            ranks = list(range(first, min(first + self.local_size, size)))
            group = self.comm.new_group(ranks)
            if group is not None:
                mine = group
        return mine


# BlueFog's default fusion threshold (bytes) and cycle time (ms).
_FUSION_THRESHOLD = 8 * 1024 * 1024
_CYCLE_TIME_MS = 0.5


def _env_number(name: str, default, kind):
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if not 0 <= value < float("inf"):  # also rejects nan
        raise ValueError(f"{name} must be a number >= 0, got {text!r}")
    return value


def _agreed_threshold(comm) -> int:
    """BLUEFOG_FUSION_THRESHOLD (bytes, 0: no fusion), the smallest of the
    ranks' values: fused or not, every rank must run the same ops."""
    mine = _env_number("BLUEFOG_FUSION_THRESHOLD", _FUSION_THRESHOLD, int)
    if comm.size == 1:
        return mine
    values = torch.tensor([mine, -mine], dtype=torch.int64)
    agreed = torch.empty_like(values)
    comm.allreduce(tensor_view(values), tensor_view(agreed), "min")
    smallest, largest = int(agreed[0]), -int(agreed[1])
    if smallest != largest:
        log("warning", f"bf.init: BLUEFOG_FUSION_THRESHOLD differs between ranks ({smallest} to "
                       f"{largest} bytes); every rank uses {smallest}")
    return smallest


def _cycle_time_s() -> float:
    return _env_number("BLUEFOG_CYCLE_TIME", _CYCLE_TIME_MS, float) / 1000.0


def _local_size_from_env(world: int) -> int:
    """LOCAL_WORLD_SIZE, or BLUEFOG_NODES_PER_MACHINE when set (BlueFog's tests
    simulate several machines on one with it)."""
    text = os.environ.get("BLUEFOG_NODES_PER_MACHINE") or str(bagua.get_local_size())
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"BLUEFOG_NODES_PER_MACHINE must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"the local size must be positive, got {value}")
    return min(value, world)


_state: Optional[_State] = None


def state() -> _State:
    if _state is None:
        raise ValueError(_NOT_INITIALIZED)
    return _state


def init(topology_fn=None, is_weighted: bool = False) -> None:
    """Initialises BlueFog once (bagua's process group too if needed); called
    again, it re-applies ``topology_fn(size())`` or ExponentialGraph(size())."""
    global _state
    if _state is None:
        if not bagua.is_initialized():
            bagua.init_process_group()
        _state = _State()
        _timeline.setup(_state.comm.rank)
    topology = topology_fn(size()) if topology_fn is not None else None
    if not set_topology(topology, is_weighted):
        raise ValueError(f"bf.init: rank {rank()} could not set the topology: the ranks passed "
                         "different topologies")


def shutdown() -> None:
    """Stops BlueFog's worker thread; idempotent. bagua's process group stays."""
    global _state
    if _state is not None:
        if _state.windows is not None:  # the window service (_windows), if one was created
            _state.windows.close()
            _state.windows = None
        _state.worker.shutdown(wait=True)
        _state = None


def is_initialized() -> bool:
    return _state is not None


def size() -> int:
    return state().comm.size


def rank() -> int:
    return state().comm.rank


def local_size() -> int:
    return state().local_size


def local_rank() -> int:
    return rank() % local_size()


def machine_size() -> int:
    return size() // local_size()


def machine_rank() -> int:
    return rank() // local_size()


def is_homogeneous() -> bool:
    return state().homogeneous


def nccl_built() -> bool:
    return not core.nccl_unavailable_reason()


def mpi_threads_supported() -> bool:
    return False  # no MPI at all


def unified_mpi_window_model_supported() -> bool:
    return True


def set_skip_negotiate_stage(value: bool) -> None:
    """BlueFog's switch; here True skips the pattern check of static
    neighbour calls (their topology was agreed by set_topology)."""
    state().skip_negotiate = bool(value)


def get_skip_negotiate_stage() -> bool:
    return state().skip_negotiate


def suspend() -> None:
    """BlueFog's interactive-mode pause: nothing runs in the background here."""
    state()


def resume() -> None:
    state()


# -- topology -------------------------------------------------------------------------
def _digest(topology: Optional[nx.DiGraph], is_weighted: bool) -> int:
    """A nonzero 63-bit digest of the weight matrix (0: no valid graph)."""
    if topology is None:
        return 0
    w = nx.to_numpy_array(topology, nodelist=sorted(topology.nodes()))
    h = hashlib.sha256(np.ascontiguousarray(w).tobytes() + bytes([is_weighted]))
    return int.from_bytes(h.digest()[:8], "little") >> 1 or 1


def _agree(value: int) -> List[int]:
    """Every rank's ``value``: an allgather on BlueFog's communicator, run
    on its worker thread in issue order like every BlueFog call."""
    st = state()
    gathered = torch.empty(st.comm.size, dtype=torch.int64)
    future = st.worker.submit(_timeline.traced(
        lambda: bagua.allgather(torch.tensor([value], dtype=torch.int64), gathered, comm=st.comm),
        "ALLGATHER", None))
    with st.worker.waiting():  # the worker stops waiting for more calls to fuse
        future.result(timeout=core.env().comm_timeout_s + 60)
    return gathered.tolist()


def _topology_error(topology, n: int) -> Optional[TypeError]:
    if not isinstance(topology, nx.DiGraph):
        return TypeError(f"topology must be a networkx.DiGraph, got {type(topology).__name__}")
    if sorted(topology.nodes()) != list(range(n)):
        return TypeError(f"topology must have the {n} nodes 0..{n - 1} (one per rank), got "
                         f"{topology.number_of_nodes()} nodes")
    return None


def _agreed(what: str, topology, n: int, is_weighted: bool) -> bool:
    """Collective: True if every rank passed the same valid graph of ``n``
    nodes. A graph that is not a DiGraph of n nodes raises TypeError on its
    rank after the comparison, so the others return False instead of hanging."""
    error = _topology_error(topology, n)
    digest = 0 if error else _digest(topology, is_weighted)
    digests = _agree(digest)
    if error:
        raise error
    if len(set(digests)) != 1:
        log("warning", f"bf.{what}: rank {rank()}: the ranks passed different topologies "
                       f"(digests {digests}); the topology is unchanged")
        return False
    return True


def set_topology(topology: Optional[nx.DiGraph] = None, is_weighted: bool = False) -> bool:
    """Sets the topology (None: ExponentialGraph(size())). Collective: the
    ranks compare digests, so if they pass different graphs every rank gets
    False and keeps its topology (BlueFog issue #90). A graph that is not a
    DiGraph of size() nodes raises TypeError on its rank and makes the others
    return False. Setting the current graph again returns True."""
    st = state()
    if topology is None:
        topology = topology_util.ExponentialGraph(size())
    if not _agreed("set_topology", topology, size(), is_weighted):
        return False
    if _digest(topology, is_weighted) != _digest(st.topology, st.is_weighted):
        st.topology, st.is_weighted = topology, bool(is_weighted)
    return True


def load_topology() -> nx.DiGraph:
    return state().topology


def is_topo_weighted() -> bool:
    return state().is_weighted


def in_neighbor_ranks() -> List[int]:
    """The ranks this rank receives from, self excluded, ascending."""
    me = rank()
    return sorted(r for r in state().topology.predecessors(me) if r != me)


def out_neighbor_ranks() -> List[int]:
    """The ranks this rank sends to, self excluded, ascending."""
    me = rank()
    return sorted(r for r in state().topology.successors(me) if r != me)


def set_machine_topology(topology: Optional[nx.DiGraph], is_weighted: bool = False) -> bool:
    """The topology between machines (one node per machine). Collective, with
    the agreement check of set_topology: different graphs on different ranks
    give False everywhere and keep the machine topology."""
    st = state()
    if topology is None:
        raise ValueError("set_machine_topology needs a topology (a networkx.DiGraph)")
    if not _agreed("set_machine_topology", topology, machine_size(), is_weighted):
        return False
    st.machine_topology, st.machine_is_weighted = topology, bool(is_weighted)
    return True


def load_machine_topology() -> Optional[nx.DiGraph]:
    return state().machine_topology


def is_machine_topo_weighted() -> bool:
    return state().machine_is_weighted


def in_neighbor_machine_ranks() -> List[int]:
    topo, me = _machine_topology(), machine_rank()
    return sorted(r for r in topo.predecessors(me) if r != me)


def out_neighbor_machine_ranks() -> List[int]:
    topo, me = _machine_topology(), machine_rank()
    return sorted(r for r in topo.successors(me) if r != me)


def _machine_topology() -> nx.DiGraph:
    topo = state().machine_topology
    if topo is None:
        raise RuntimeError("no machine topology: call bf.set_machine_topology first")
    return topo
