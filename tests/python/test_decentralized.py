"""Decentralized and asynchronous training across processes."""

import pytest
import torch

import bagua.torch_api as bagua
import bagua_core
from bagua.torch_api.algorithms import async_model_average, decentralized
from launcher import run_workers


def shift_one_reference(rank, n, step):
    """The guide's formula, extended to odd n with a virtual rank n."""
    m = n if n % 2 == 0 else n + 1
    h = m // 2
    peer = ((step + rank) % h) + h if rank < h else (rank - h - step) % h
    return -1 if peer >= n else peer


@pytest.mark.parametrize("n", range(2, 9))
def test_shift_one_peers_match_the_formula_and_are_symmetric(n):
    for step in range(10):
        for rank in range(n):
            peer = bagua_core._testing.shift_one_peer(rank, n, step)
            assert peer == shift_one_reference(rank, n, step)
            if peer >= 0:
                assert bagua_core._testing.shift_one_peer(peer, n, step) == rank


def _reference_average(mode, before, n, rank, step):
    if mode == "all":
        return sum(before) / n
    if mode == "shift_one":
        peer = shift_one_reference(rank, n, step)
        return before[rank] if peer < 0 else (before[rank] + before[peer]) / 2
    left, right = (rank - 1) % n, (rank + 1) % n
    if n == 2:
        return (before[rank] + before[left]) / 2
    return (before[rank] + before[left] + before[right]) / 3


@pytest.mark.parametrize("mode,world_size", [("all", 3), ("shift_one", 4), ("shift_one", 5),
                                             ("ring", 4), ("ring", 5)])
def test_one_step_matches_the_python_reference(mode, world_size, tmp_path):
    results = run_workers("decentralized", world_size, tmp_path, args=(mode,))
    _check_steps(results, lambda before, rank, step: _reference_average(mode, before, world_size, rank, step))


def _check_steps(results, average):
    """Each rank's weights after each step = average(weights of every rank
    before it, rank, step) - lr * its gradient; the ranks' weights differ."""
    lr = results[0]["lr"]
    for step in range(len(results[0]["steps"])):
        before = [r["steps"][step]["before"] for r in results]
        for rank, r in enumerate(results):
            s = r["steps"][step]
            torch.testing.assert_close(s["after"], average(before, rank, step) - lr * s["grad"], rtol=0, atol=1e-6)
        assert any(not torch.equal(before[0], b) for b in before[1:])


def _topology_reference(kind, before, n, rank, step):
    """One neighbour-averaging step of DecentralizedAlgorithm(topology=...),
    from BlueFog's own definitions of the graphs and schedules."""
    from bagua.bluefog import topology_util as tu

    graph = tu.ExponentialGraph(n)
    if kind == "exponential":
        w = tu.nx.to_numpy_array(graph, nodelist=range(n))
        return sum(float(w[j, rank]) * before[j] for j in range(n) if w[j, rank] != 0)
    if kind == "ring_unweighted":
        peers = sorted({(rank - 1) % n, (rank + 1) % n} - {rank})
        return (before[rank] + sum(before[j] for j in peers)) / (len(peers) + 1)
    # dynamic: every rank's schedule replayed to this step; a rank receives
    # from those whose send list names it.
    schedules = [tu.GetDynamicOnePeerSendRecvRanks(graph, r) for r in range(n)]
    for _ in range(step + 1):
        pairs = [next(s) for s in schedules]
    receives = pairs[rank][1]
    assert all(rank in pairs[j][0] for j in receives)
    weight = 1.0 / (len(receives) + 1)
    return weight * before[rank] + sum(weight * before[j] for j in receives)


@pytest.mark.parametrize("kind,world_size", [("exponential", 2), ("exponential", 5), ("ring_unweighted", 3),
                                             ("ring_unweighted", 4), ("dynamic", 4), ("dynamic", 5)])
def test_topology_step_matches_bluefogs_definitions(kind, world_size, tmp_path):
    results = run_workers("decentralized_topology", world_size, tmp_path, args=(kind,))
    _check_steps(results, lambda before, rank, step: _topology_reference(kind, before, world_size, rank, step))
    assert all(n == 5 for n in results[0]["executions"])  # one neighbour allreduce per step


def test_topology_arguments_are_checked():
    from bagua.bluefog import topology_util as tu
    from bagua.torch_api.algorithms.decentralized import _TopologyPatterns

    with pytest.raises(bagua.InvalidArgumentError, match="hierarchical=False"):
        decentralized.DecentralizedAlgorithm(topology=tu.RingGraph(4))
    with pytest.raises(bagua.InvalidArgumentError, match="peer_selection_mode"):
        decentralized.DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="ring",
                                             topology=tu.RingGraph(4))
    with pytest.raises(bagua.InvalidArgumentError, match="the 3 nodes"):
        _TopologyPatterns(tu.RingGraph(4), 0, 3)
    with pytest.raises(bagua.InvalidArgumentError, match="networkx.DiGraph"):
        _TopologyPatterns([1, 2], 0, 2)
    heavy = tu.nx.DiGraph()
    heavy.add_weighted_edges_from([(0, 1, 0.9), (1, 0, 0.9), (0, 0, 0.5), (1, 1, 0.5)])
    with pytest.raises(bagua.InvalidArgumentError, match="sum to 1.4"):
        _TopologyPatterns(heavy, 0, 2)
    assert _TopologyPatterns(tu.RingGraph(4), 1, 4).next() == (pytest.approx(1 / 3), {0: pytest.approx(1 / 3),
                                                                                     2: pytest.approx(1 / 3)},
                                                              {0: 1.0, 2: 1.0})
    ended = _TopologyPatterns(iter([([1], [1])]), 0, 2)
    assert ended.next() == (0.5, {1: 0.5}, {1: 1.0})
    with pytest.raises(bagua.InvalidArgumentError, match="ran out"):
        ended.next()


def test_communication_interval_two_communicates_on_odd_steps_only(tmp_path):
    results = run_workers("decentralized", 3, tmp_path, args=("all", "2"))
    lr = results[0]["lr"]
    for rank, r in enumerate(results):
        assert r["executions"] and all(n == 3 for n in r["executions"])  # steps 1, 3 and 5 of 5
        for index, s in enumerate(r["steps"]):
            step = index + 1
            if step % 2 == 1:
                average = sum(x["steps"][index]["before"] for x in results) / 3
                torch.testing.assert_close(s["after"], average - lr * s["grad"], rtol=0, atol=1e-6)
            else:  # a purely local step
                torch.testing.assert_close(s["after"], s["before"] - lr * s["grad"], rtol=0, atol=1e-6)


def test_async_fast_ranks_keep_their_pace_with_a_straggler(tmp_path):
    results = run_workers("async_straggler", 4, tmp_path, timeout=300)
    for rank in range(3):  # the fast ranks
        r = results[rank]
        assert r["rate_straggler"] >= 0.8 * r["rate_unslowed"], r
    assert results[3]["rate_straggler"] < 0.5 * results[3]["rate_unslowed"]
    # The ranks' models stay much closer to each other than the same training
    # without communication leaves them (each rank sees different data).
    def disagreement(params):
        return (params - params.mean(0)).norm(dim=1).max().item()

    averaged, alone = disagreement(results[0]["params_trained"]), disagreement(results[0]["params_local"])
    assert averaged < 0.5 * alone, (averaged, alone)
    idle = results[0]["params_idle"]
    torch.testing.assert_close(idle, idle[0].expand_as(idle), rtol=0, atol=1e-6)  # then equal
    assert all(r["status"] == ["stopped"] for r in results)


def test_async_fifty_abort_resume_cycles_with_uneven_steps_end_cleanly(tmp_path):
    results = run_workers("async_abort_resume", 4, tmp_path, timeout=300)
    assert len({r["steps"] for r in results}) > 1  # the ranks ran different numbers of steps
    for r in results:
        assert r["status"] == ["stopped"]
    assert len({tuple(r["rounds"]) for r in results}) == 1  # every rank ran the same rounds


def test_decentralized_algorithm_arguments_are_checked():
    with pytest.raises(bagua.InvalidArgumentError, match="peer_selection_mode"):
        decentralized.DecentralizedAlgorithm(peer_selection_mode="star")
    with pytest.raises(bagua.InvalidArgumentError, match="communication_interval"):
        decentralized.DecentralizedAlgorithm(communication_interval=0)
    with pytest.raises(bagua.InvalidArgumentError, match="peer_selection_mode"):
        async_model_average.AsyncModelAverageAlgorithm(peer_selection_mode="ring")
    with pytest.raises(bagua.InvalidArgumentError, match="sync_interval_ms"):
        async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=-1)
