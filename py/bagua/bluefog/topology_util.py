"""BlueFog's topologies, as ``networkx.DiGraph`` weight matrices.

``W[u, v]`` (the edge u -> v's ``weight``) is the weight rank v applies to
what it receives from rank u; rank u sends to its successors and receives
from its predecessors. The names, arguments and matrices are BlueFog's
(``bluefog.common.topology_util`` and ``bluefog.torch.topology_util``), so
``from bagua.bluefog import topology_util`` is the only change a script needs.

Where BlueFog's own code is inexact we follow its documented meaning: powers
of ``base`` are found with integer arithmetic (BlueFog's ``math.log`` misses
e.g. 243 = 3**5), and argument errors are ``ValueError`` rather than
``assert``. The dynamic generators yield ``(send_ranks, recv_ranks)`` for
steps 0, 1, 2, ... forever; at every step the ranks' schedules are
consistent (r sends to s exactly when s receives from r).
"""

import collections
import math
from typing import Dict, Iterator, List, Optional, Tuple

import networkx as nx
import numpy as np

__all__ = [
    "IsTopologyEquivalent", "GetRecvWeights", "GetSendWeights", "IsRegularGraph", "isPowerOf",
    "ExponentialTwoGraph", "ExponentialGraph", "SymmetricExponentialGraph", "MeshGrid2DGraph",
    "StarGraph", "RingGraph", "FullyConnectedGraph", "InnerOuterRingGraph", "InnerOuterExp2Graph",
    "GetDynamicOnePeerSendRecvRanks", "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks", "GetInnerOuterExpo2DynamicSendRecvRanks",
    "InferSourceFromDestinationRanks", "InferDestinationFromSourceRanks",
    # Older BlueFog names of the same functions.
    "PowerTwoRingGraph", "PowerGraph", "SymmetricPowerGraph", "GetDynamicSendRecvRanks",
]


def _check_size(size, what="size") -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"{what} must be a positive integer, got {size!r}")
    return int(size)


def _from_matrix(topo: np.ndarray) -> nx.DiGraph:
    """The DiGraph of a weight matrix: an edge for every nonzero entry."""
    return nx.from_numpy_array(topo, create_using=nx.DiGraph)


def _weight_matrix(topo: nx.DiGraph) -> np.ndarray:
    return nx.to_numpy_array(topo, nodelist=sorted(topo.nodes()))


def _circulant(size: int, offsets) -> nx.DiGraph:
    """Row r: weight 1/|S| at columns (r + d) mod size, d in S (0 included)."""
    x = np.zeros(size)
    for d in offsets:
        x[d % size] = 1.0
    x[0] = 1.0
    x /= x.sum()
    return _from_matrix(np.stack([np.roll(x, r) for r in range(size)]))


def isPowerOf(x: int, base: int) -> bool:
    """Whether the positive integer ``x`` is ``base`` ** k for some k >= 0."""
    if isinstance(base, bool) or not isinstance(base, (int, np.integer)) or base < 2:
        raise ValueError(f"base must be an integer larger than 1, got {base!r}")
    if x < 1:
        raise ValueError(f"isPowerOf needs a positive integer, got {x!r}")
    while x % base == 0:
        x //= base
    return x == 1


def IsTopologyEquivalent(topo1: nx.DiGraph, topo2: nx.DiGraph) -> bool:
    """Same node and edge counts and the same weighted adjacency matrix (not
    isomorphism)."""
    if topo1 is None or topo2 is None:
        return False
    if topo1.number_of_nodes() != topo2.number_of_nodes():
        return False
    if topo1.number_of_edges() != topo2.number_of_edges():
        return False
    return bool((_weight_matrix(topo1) == _weight_matrix(topo2)).all())


def GetRecvWeights(topo: nx.DiGraph, rank: int) -> Tuple[float, Dict[int, float]]:
    """(W[rank, rank], {u: W[u, rank]} for in-neighbours u != rank)."""
    w = _weight_matrix(topo)
    self_weight, neighbors = 0.0, {}
    for src in topo.predecessors(rank):
        if src == rank:
            self_weight = float(w[rank, rank])
        else:
            neighbors[src] = float(w[src, rank])
    return self_weight, neighbors


def GetSendWeights(topo: nx.DiGraph, rank: int) -> Tuple[float, Dict[int, float]]:
    """(W[rank, rank], {v: W[rank, v]} for out-neighbours v != rank)."""
    w = _weight_matrix(topo)
    self_weight, neighbors = 0.0, {}
    for dst in topo.successors(rank):
        if dst == rank:
            self_weight = float(w[rank, rank])
        else:
            neighbors[dst] = float(w[rank, dst])
    return self_weight, neighbors


def IsRegularGraph(topo: nx.DiGraph) -> bool:
    """Whether every node has the same degree (in + out)."""
    degrees = {topo.degree(node) for node in topo.nodes()}
    return len(degrees) <= 1


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """Rank r sends to r + 2**j (mod size) for 2**j < size; uniform weights."""
    size = _check_size(size)
    return _circulant(size, [d for d in range(1, size) if d & (d - 1) == 0])


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """Rank r sends to r + d (mod size) for every power d of ``base`` below
    size (1 included); uniform weights."""
    size = _check_size(size)
    return _circulant(size, [d for d in range(1, size) if isPowerOf(d, base)])


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """As ExponentialGraph with d kept when min(d, size - d) is a power of
    ``base``, so the graph is undirected."""
    size = _check_size(size)
    return _circulant(size, [d for d in range(1, size) if isPowerOf(min(d, size - d), base)])


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """Every rank sends to every rank; all weights 1/size."""
    size = _check_size(size)
    return _circulant(size, range(size))


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """connect_style 0: both ring neighbours, weights 1/3; 1 (left): r sends
    to r - 1, weights 1/2; 2 (right): r sends to r + 1, weights 1/2. One rank
    is [[1]] and two ranks are all 0.5, whatever the style."""
    size = _check_size(size)
    if connect_style not in (0, 1, 2):
        raise ValueError(f"connect_style must be 0 (both), 1 (left) or 2 (right), got "
                         f"{connect_style!r}")
    if size <= 2:
        return _from_matrix(np.full((size, size), 1.0 / size))
    offsets = {0: [1, -1], 1: [-1], 2: [1]}[connect_style]
    return _circulant(size, offsets)


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """Every rank exchanges with ``center_rank``: W[i, i] = 1 - 1/size for
    i != center, W[center, i] = W[i, center] = 1/size (doubly stochastic)."""
    size = _check_size(size)
    if not 0 <= center_rank < size:
        raise ValueError(f"center_rank {center_rank} is not a rank of a world of {size}")
    topo = np.zeros((size, size))
    for i in range(size):
        topo[i, i] = 1 - 1 / size
        topo[center_rank, i] = 1 / size
        topo[i, center_rank] = 1 / size
    return _from_matrix(topo)


def _mesh_shape(size: int, shape) -> Tuple[int, int]:
    if shape is None:
        nrow = math.isqrt(size)
        while size % nrow != 0:
            nrow -= 1
        return nrow, size // nrow
    nrow, ncol = shape
    if nrow * ncol != size:
        raise ValueError(f"MeshGrid2DGraph: shape {tuple(shape)} does not hold {size} ranks")
    return nrow, ncol


def MeshGrid2DGraph(size: int, shape: Optional[Tuple[int, int]] = None) -> nx.DiGraph:
    """A nrow x ncol grid (default: nrow the largest divisor of size not above
    its square root), 4-neighbourhood without wrap-around, Metropolis-Hastings
    weights W[i, j] = 1 / max(d_i, d_j) (d counts the node itself) and
    W[i, i] = 1 - sum of the others."""
    size = _check_size(size)
    nrow, ncol = _mesh_shape(size, shape)
    adjacent = np.eye(size, dtype=bool)
    for i in range(size):
        if (i + 1) % ncol != 0:
            adjacent[i, i + 1] = adjacent[i + 1, i] = True
        if i + ncol < size:
            adjacent[i, i + ncol] = adjacent[i + ncol, i] = True
    degree = adjacent.sum(axis=1)
    topo = np.zeros((size, size))
    for i in range(size):
        for j in np.nonzero(adjacent[i])[0]:
            if i != j:
                topo[i, j] = 1.0 / max(degree[i], degree[j])
        topo[i, i] = 1.0 - topo[i].sum()
    return _from_matrix(topo)


def _machines(world_size: int, local_size: int) -> int:
    _check_size(world_size, "world_size")
    _check_size(local_size, "local_size")
    if world_size % local_size != 0:
        raise ValueError(f"world size {world_size} is not a multiple of the local size "
                         f"{local_size}: only homogeneous machines are supported")
    return world_size // local_size


def _inner_outer_graph(world_size: int, local_size: int, machine_hop) -> nx.DiGraph:
    """Fully connected inside a machine; same local ranks of machines m and
    m + d connected where machine_hop(d); rows normalised as BlueFog does
    (numpy's ``topo / topo.sum(axis=1)``)."""
    machines = _machines(world_size, local_size)
    topo = np.zeros((world_size, world_size))
    for i in range(world_size):
        for j in range(world_size):
            mi, li = divmod(i, local_size)
            mj, lj = divmod(j, local_size)
            if mi == mj:
                topo[i, j] = 1
            elif li == lj and machine_hop((mj - mi) % machines):
                topo[i, j] = 1
    return _from_matrix(topo / topo.sum(axis=1))


def InnerOuterRingGraph(world_size: int, local_size: int) -> nx.DiGraph:
    """The static graph holding GetInnerOuterRingDynamicSendRecvRanks' edges."""
    return _inner_outer_graph(world_size, local_size, lambda d: d == 1)


def InnerOuterExp2Graph(world_size: int, local_size: int) -> nx.DiGraph:
    """The static graph holding GetInnerOuterExpo2DynamicSendRecvRanks' edges."""
    return _inner_outer_graph(world_size, local_size, lambda d: isPowerOf(d, 2))


def GetDynamicOnePeerSendRecvRanks(topo: nx.DiGraph,
                                   self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Each step every rank sends to one out-neighbour, taken clockwise
    ((v - r) mod n order, self excluded) in turn: at step k rank r sends to
    its (k mod outdeg_r)-th and receives from every rank whose k-th is r."""
    size = topo.number_of_nodes()
    ordered = []
    for rank in range(size):
        succ = [v for v in topo.successors(rank) if v != rank]
        ordered.append(sorted(succ, key=lambda v, r=rank: (v - r) % size))
    index = 0
    while True:
        def target(rank):
            return ordered[rank][index % len(ordered[rank])] if ordered[rank] else None
        send = [] if target(self_rank) is None else [target(self_rank)]
        recv = [r for r in range(size) if r != self_rank and target(r) == self_rank]
        yield send, recv
        index += 1


def GetExp2DynamicSendRecvMachineRanks(world_size: int, local_size: int, self_rank: int,
                                       local_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Machine m sends to machine m + 2**(k mod (e+1)) and receives from
    m - 2**(k mod (e+1)) (mod M machines), e = floor(log2(M - 1))."""
    machines = _machines(world_size, local_size)
    if self_rank % local_size != local_rank:
        raise ValueError(f"rank {self_rank} with local rank {local_rank}: machines must all hold "
                         f"{local_size} ranks")
    if machines < 2:
        raise ValueError("GetExp2DynamicSendRecvMachineRanks needs at least two machines")
    machine = self_rank // local_size
    exponents = int(math.log2(machines - 1)) + 1
    index = 0
    while True:
        hop = 2 ** (index % exponents)
        yield [(machine + hop) % machines], [(machine - hop) % machines]
        index += 1


def _inner_outer_ranks(world_size, local_size, self_rank, machine_hop, inner_hop):
    """The inner-outer schedules: at step k local rank k mod L of every
    machine leaves (to the same local rank of machine m + machine_hop(k));
    the others send inside the machine, inner_hop(k, distance to the leaving
    rank) ahead, and receive from the rank for which they are that far ahead."""
    machines = _machines(world_size, local_size)
    if local_size <= 2:
        raise ValueError(f"inner-outer schedules need more than 2 ranks per machine, got "
                         f"{local_size}; use hierarchical_neighbor_allreduce or "
                         "GetDynamicOnePeerSendRecvRanks")
    if machines < 2:
        raise ValueError("inner-outer schedules need at least two machines (with one, the "
                         "leaving rank would send to itself)")
    machine, local = divmod(self_rank, local_size)
    index = 0
    while True:
        outgoing = index % local_size
        if local == outgoing:
            hop = machine_hop(index, machines)
            send = ((machine + hop) % machines) * local_size + local
            recv = ((machine - hop) % machines) * local_size + local
        else:
            ahead = inner_hop(index, (outgoing - local) % local_size)
            behind = inner_hop(index, (local - outgoing) % local_size)
            send = machine * local_size + (local + ahead) % local_size
            recv = machine * local_size + (local - behind) % local_size
        yield [send], [recv]
        index += 1


def GetInnerOuterRingDynamicSendRecvRanks(
        world_size: int, local_size: int, self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Outer ring between machines, inner ring inside, skipping the rank
    that leaves the machine this step."""
    def inner(_, distance):
        return 2 if distance == 1 else 1
    return _inner_outer_ranks(world_size, local_size, self_rank, lambda _k, _m: 1, inner)


def GetInnerOuterExpo2DynamicSendRecvRanks(
        world_size: int, local_size: int, self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Exponential-2 hops between machines (2**(k mod (floor(log2(M-1))+1)))
    and inside them (2**(k mod (floor(log2(L-2))+1)), one more when it
    reaches the leaving rank)."""
    def machine_hop(index, machines):
        exponents = int(math.log2(machines - 1)) + 1 if machines > 1 else 1
        return 2 ** (index % exponents)

    inner_exponents = int(math.log2(local_size - 2)) + 1 if local_size > 2 else 1

    def inner(index, distance):
        hop = 2 ** (index % inner_exponents)
        return hop + 1 if hop >= distance else hop
    return _inner_outer_ranks(world_size, local_size, self_rank, machine_hop, inner)


def _check_rank_list(ranks, what: str) -> List[int]:
    from bagua import bluefog as bf
    size, rank = bf.size(), bf.rank()
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise ValueError(f"{what} must hold integer ranks, got {r!r}")
        if not 0 <= r < size:
            raise ValueError(f"{what}: {r} is not a rank of a world of {size}")
        out.append(int(r))
    if len(set(out)) != len(out):
        raise ValueError(f"{what} names a rank twice: {out}")
    if rank in out:
        raise ValueError(f"{what} names this rank ({rank}) itself")
    return out


def _infer_topo(ranks: List[int], transpose: bool, construct_adjacency_matrix: bool):
    """Collective: every rank's list (two allgathers), inverted for this
    rank; with the flag also W (1 on edges and the diagonal) normalised as
    BlueFog does, ``W / W.sum(axis=1)``."""
    import torch
    from bagua import bluefog as bf
    degrees = bf.allgather(torch.tensor([len(ranks)], dtype=torch.int64)).tolist()
    gathered = bf.allgather(torch.tensor(ranks, dtype=torch.int64)).tolist()
    adjacency, offset = {}, 0
    for owner, degree in enumerate(degrees):
        adjacency[owner] = sorted(gathered[offset:offset + degree])
        offset += degree
    inverse = collections.defaultdict(list)
    for owner, adj in adjacency.items():
        for v in adj:
            inverse[v].append(owner)
    result = inverse.get(bf.rank(), [])
    if not construct_adjacency_matrix:
        return result
    w = np.eye(bf.size())
    for owner, adj in adjacency.items():
        w[owner, adj] = 1
    if transpose:
        w = w.T
    return result, w / w.sum(axis=1)


def InferSourceFromDestinationRanks(dst_ranks: List[int], construct_adjacency_matrix: bool = False):
    """Collective: the ranks that send to this rank, given every rank's
    destinations (and, with the flag, the weight matrix W[i, j] of i -> j)."""
    return _infer_topo(_check_rank_list(dst_ranks, "dst_ranks"), False, construct_adjacency_matrix)


def InferDestinationFromSourceRanks(src_ranks: List[int], construct_adjacency_matrix: bool = False):
    """Collective: the ranks this rank sends to, given every rank's sources."""
    return _infer_topo(_check_rank_list(src_ranks, "src_ranks"), True, construct_adjacency_matrix)


# BlueFog's older names.
PowerTwoRingGraph = ExponentialTwoGraph
PowerGraph = ExponentialGraph
SymmetricPowerGraph = SymmetricExponentialGraph
GetDynamicSendRecvRanks = GetDynamicOnePeerSendRecvRanks
