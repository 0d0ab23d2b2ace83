"""bagua.bluefog.topology_util: every generator's weight matrix against its
closed form (design bluefog.md section 4), and every dynamic schedule for
consistency (r sends to s exactly when s receives from r) over all ranks."""

import itertools
import math

import networkx as nx
import numpy as np
import pytest

from bagua.bluefog import topology_util as tu

SIZES = range(1, 10)


def matrix(g):
    return nx.to_numpy_array(g, nodelist=range(g.number_of_nodes()))


def circulant(n, offsets):
    """Row r: 1/|S| at (r + d) mod n for d in S = offsets + {0}."""
    s = {0} | {d % n for d in offsets}
    w = np.zeros((n, n))
    for r in range(n):
        for d in s:
            w[r, (r + d) % n] = 1 / len(s)
    return w


def assert_matrix(g, expected):
    assert isinstance(g, nx.DiGraph)
    got = matrix(g)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
    # Edges are exactly the nonzero entries.
    assert g.number_of_edges() == int((expected != 0).sum())


@pytest.mark.parametrize("n", SIZES)
def test_exponential_two_graph(n):
    assert_matrix(tu.ExponentialTwoGraph(n), circulant(n, [2 ** j for j in range(n) if 2 ** j < n]))


@pytest.mark.parametrize("n,base", [(n, b) for n in range(1, 30, 3) for b in (2, 3, 4)])
def test_exponential_graph(n, base):
    powers = [base ** j for j in range(n) if base ** j < n]
    assert_matrix(tu.ExponentialGraph(n, base), circulant(n, powers))


def test_exponential_graph_finds_powers_that_a_float_log_misses():
    # math.log(243, 3) is 4.999..., which BlueFog's isPowerOf truncates to 4.
    assert tu.isPowerOf(243, 3)
    assert matrix(tu.ExponentialGraph(244, 3))[0, 243] > 0
    assert not tu.isPowerOf(6, 2) and tu.isPowerOf(1, 5)
    with pytest.raises(ValueError):
        tu.isPowerOf(4, 1)


@pytest.mark.parametrize("n", range(1, 20))
def test_symmetric_exponential_graph(n):
    offsets = [d for d in range(1, n) if min(d, n - d) in {4 ** j for j in range(8)}]
    w = matrix(tu.SymmetricExponentialGraph(n))
    assert_matrix(tu.SymmetricExponentialGraph(n), circulant(n, offsets))
    np.testing.assert_array_equal(w > 0, (w > 0).T)  # undirected


@pytest.mark.parametrize("n", SIZES)
def test_fully_connected_graph(n):
    assert_matrix(tu.FullyConnectedGraph(n), np.full((n, n), 1 / n))


@pytest.mark.parametrize("n", SIZES)
def test_ring_graph_styles(n):
    if n == 1:
        for style in (0, 1, 2):
            assert_matrix(tu.RingGraph(1, style), np.ones((1, 1)))
        return
    if n == 2:
        for style in (0, 1, 2):
            assert_matrix(tu.RingGraph(2, style), np.full((2, 2), 0.5))
        return
    assert_matrix(tu.RingGraph(n), circulant(n, [1, -1]))
    assert matrix(tu.RingGraph(n))[0, 1] == 1 / 3
    # left: r sends to r - 1 (receives from r + 1); right: r sends to r + 1.
    assert_matrix(tu.RingGraph(n, 1), circulant(n, [-1]))
    assert_matrix(tu.RingGraph(n, 2), circulant(n, [1]))
    assert matrix(tu.RingGraph(n, 1))[1, 0] == 0.5


def test_ring_graph_rejects_other_styles():
    for style in (-1, 3, "left"):
        with pytest.raises(ValueError, match="connect_style"):
            tu.RingGraph(5, style)


@pytest.mark.parametrize("n", SIZES)
def test_star_graph_every_centre(n):
    for c in range(n):
        expected = np.zeros((n, n))
        for i in range(n):
            expected[i, i] = 1 - 1 / n
            expected[c, i] = expected[i, c] = 1 / n
        expected[c, c] = 1 / n
        w = matrix(tu.StarGraph(n, c))
        assert_matrix(tu.StarGraph(n, c), expected)
        np.testing.assert_allclose(w.sum(axis=0), 1)  # doubly stochastic
        np.testing.assert_allclose(w.sum(axis=1), 1)
    with pytest.raises(ValueError):
        tu.StarGraph(n, n)


def mesh_expected(nrow, ncol):
    n = nrow * ncol
    pos = [divmod(i, ncol) for i in range(n)]
    adj = [[i for i in range(n) if abs(pos[i][0] - pos[j][0]) + abs(pos[i][1] - pos[j][1]) <= 1]
           for j in range(n)]
    w = np.zeros((n, n))
    for i in range(n):
        for j in adj[i]:
            if j != i:
                w[i, j] = 1 / max(len(adj[i]), len(adj[j]))
        w[i, i] = 1 - w[i].sum()
    return w


@pytest.mark.parametrize("n,shape", [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (6, (2, 3)),
                                     (7, (1, 7)), (12, (3, 4)), (16, (4, 4)), (24, (4, 6))])
def test_mesh_grid_default_shape(n, shape):
    w = matrix(tu.MeshGrid2DGraph(n))
    assert_matrix(tu.MeshGrid2DGraph(n), mesh_expected(*shape))
    np.testing.assert_allclose(w, w.T)  # Metropolis-Hastings weights are symmetric
    np.testing.assert_allclose(w.sum(axis=1), 1)


def test_mesh_grid_given_shape():
    assert_matrix(tu.MeshGrid2DGraph(12, (2, 6)), mesh_expected(2, 6))
    with pytest.raises(ValueError, match="shape"):
        tu.MeshGrid2DGraph(12, (5, 2))


def test_topology_equivalence():
    assert tu.IsTopologyEquivalent(tu.RingGraph(6), tu.RingGraph(6))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(6), tu.RingGraph(6, 1))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(6), tu.RingGraph(7))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(6), None)
    assert not tu.IsTopologyEquivalent(None, None)
    # Same edges, other weights.
    g = tu.RingGraph(6)
    h = tu.RingGraph(6)
    h[0][1]["weight"] = 0.5
    assert not tu.IsTopologyEquivalent(g, h)
    # Equivalence is of matrices, not isomorphism: a relabelled star differs.
    assert not tu.IsTopologyEquivalent(tu.StarGraph(5, 0), tu.StarGraph(5, 1))


def test_recv_and_send_weights():
    n = 5
    self_weight, recv = tu.GetRecvWeights(tu.StarGraph(n, 2), 2)
    assert self_weight == pytest.approx(1 / n) and recv == pytest.approx({0: 1 / n, 1: 1 / n,
                                                                            3: 1 / n, 4: 1 / n})
    self_weight, recv = tu.GetRecvWeights(tu.StarGraph(n, 2), 4)
    assert self_weight == pytest.approx(1 - 1 / n) and recv == pytest.approx({2: 1 / n})
    self_weight, send = tu.GetSendWeights(tu.RingGraph(n, 2), 1)
    assert self_weight == 0.5 and send == {2: 0.5}
    self_weight, recv = tu.GetRecvWeights(tu.RingGraph(n, 2), 1)
    assert self_weight == 0.5 and recv == {0: 0.5}
    no_loop = nx.DiGraph([(0, 1), (1, 0)])
    assert tu.GetRecvWeights(no_loop, 0) == (0.0, {1: 1.0})
    assert tu.GetSendWeights(no_loop, 1) == (0.0, {0: 1.0})


def test_regular_graphs():
    assert tu.IsRegularGraph(tu.RingGraph(7))
    assert tu.IsRegularGraph(tu.ExponentialGraph(12))
    assert not tu.IsRegularGraph(tu.StarGraph(4))
    assert not tu.IsRegularGraph(tu.MeshGrid2DGraph(6))


def test_old_names_are_the_new_functions():
    assert tu.PowerGraph is tu.ExponentialGraph
    assert tu.PowerTwoRingGraph is tu.ExponentialTwoGraph
    assert tu.SymmetricPowerGraph is tu.SymmetricExponentialGraph
    assert tu.GetDynamicSendRecvRanks is tu.GetDynamicOnePeerSendRecvRanks


def schedules(make, n, steps):
    """steps x n table of (send, recv) from one generator per rank."""
    gens = [make(r) for r in range(n)]
    return [[next(g) for g in gens] for _ in range(steps)]


def assert_consistent(table):
    for step, row in enumerate(table):
        for r, (send, recv) in enumerate(row):
            assert r not in send and r not in recv, f"step {step} rank {r} names itself"
            for s in send:
                assert r in row[s][1], f"step {step}: {r} sends to {s}, which does not receive"
            for s in recv:
                assert r in row[s][0], f"step {step}: {r} receives from {s}, which does not send"


@pytest.mark.parametrize("n", range(2, 12))
def test_one_peer_schedule_on_exponential_graph(n):
    k = math.ceil(math.log2(n))
    table = schedules(lambda r: tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialGraph(n), r), n,
                      3 * k)
    assert_consistent(table)
    for step, row in enumerate(table):
        hop = 2 ** (step % k)
        for r, (send, recv) in enumerate(row):
            assert send == [(r + hop) % n] and recv == [(r - hop) % n]


@pytest.mark.parametrize("make", [lambda n: tu.MeshGrid2DGraph(n), lambda n: tu.StarGraph(n, 1),
                                  lambda n: tu.RingGraph(n, 1), lambda n: tu.FullyConnectedGraph(n),
                                  lambda n: tu.SymmetricExponentialGraph(n)])
@pytest.mark.parametrize("n", [2, 3, 5, 6, 9])
def test_one_peer_schedule_is_consistent_on_any_graph(make, n):
    g = make(n)
    table = schedules(lambda r: tu.GetDynamicOnePeerSendRecvRanks(g, r), n, 2 * n)
    assert_consistent(table)
    # Every rank sends to exactly one out-neighbour per step, in clockwise turn.
    for step, row in enumerate(table):
        for r, (send, _) in enumerate(row):
            outs = sorted((v for v in g.successors(r) if v != r), key=lambda v: (v - r) % n)
            assert send == [outs[step % len(outs)]]


def test_one_peer_schedule_of_one_rank_is_empty():
    gen = tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialGraph(1), 0)
    assert [next(gen) for _ in range(3)] == [([], [])] * 3


@pytest.mark.parametrize("machines,local", [(2, 1), (3, 2), (5, 1), (8, 2), (6, 3)])
def test_exp2_machine_schedule(machines, local):
    world = machines * local
    e = int(math.floor(math.log2(machines - 1)))
    for r in range(world):
        gen = tu.GetExp2DynamicSendRecvMachineRanks(world, local, r, r % local)
        for step in range(3 * (e + 1)):
            hop, m = 2 ** (step % (e + 1)), r // local
            assert next(gen) == ([(m + hop) % machines], [(m - hop) % machines])
    with pytest.raises(ValueError):
        next(tu.GetExp2DynamicSendRecvMachineRanks(4, 4, 0, 0))  # one machine
    with pytest.raises(ValueError):
        next(tu.GetExp2DynamicSendRecvMachineRanks(6, 3, 1, 2))  # local rank disagrees


@pytest.mark.parametrize("machines,local", itertools.product([2, 3, 4], [3, 4, 5]))
@pytest.mark.parametrize("kind", ["ring", "expo2"])
def test_inner_outer_schedules(machines, local, kind):
    world = machines * local
    make = (tu.GetInnerOuterRingDynamicSendRecvRanks if kind == "ring"
            else tu.GetInnerOuterExpo2DynamicSendRecvRanks)
    static = (tu.InnerOuterRingGraph if kind == "ring" else tu.InnerOuterExp2Graph)(world, local)
    table = schedules(lambda r: make(world, local, r), world, 3 * local)
    assert_consistent(table)
    for step, row in enumerate(table):
        for r, (send, recv) in enumerate(row):
            assert len(send) == 1 and len(recv) == 1
            assert static.has_edge(r, send[0]) and static.has_edge(recv[0], r)
            m, lr = divmod(r, local)
            if lr == step % local:  # the rank leaving the machine this step
                assert send[0] % local == lr and send[0] // local != m
            else:
                assert send[0] // local == m and send[0] % local != step % local


def test_inner_outer_ring_closed_form():
    gen = tu.GetInnerOuterRingDynamicSendRecvRanks(12, 4, 5)  # machine 1, local rank 1
    assert next(gen) == ([6], [7])  # local 0 leaves: 1 -> 2; from 0, skipped, so from 3
    assert next(gen) == ([9], [1])  # local 1 (this rank) leaves: machine 2, from machine 0
    assert next(gen) == ([7], [4])  # local 2 leaves: 1 -> 2 skipped -> 3; from 0
    assert next(gen) == ([6], [4])  # local 3 leaves: 1 -> 2; from 0


def test_inner_outer_rejects_small_machines():
    for make in (tu.GetInnerOuterRingDynamicSendRecvRanks, tu.GetInnerOuterExpo2DynamicSendRecvRanks):
        with pytest.raises(ValueError, match="more than 2"):
            next(make(4, 2, 0))
        with pytest.raises(ValueError, match="homogeneous"):
            next(make(7, 3, 0))
        with pytest.raises(ValueError, match="two machines"):
            next(make(4, 4, 0))


def test_inner_outer_static_graphs_rows():
    w = matrix(tu.InnerOuterRingGraph(6, 3))
    # numpy's topo / topo.sum(axis=1) divides column j by row j's sum; rows
    # here all hold 4 ones, so every nonzero weight is 1/4.
    assert set(np.unique(w)) == {0.0, 0.25}
