"""Ripples' network-free parts from Python: the static schedule and the group
generator engine through bagua.torch_api.algorithms._ripples_engine (binding
behaviour, argument errors) and the static schedule's serial-replay mixing
figures of docs/ripples.md (design 5.2)."""

import math

import numpy as np
import pytest

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.algorithms._ripples_engine import (
    Group,
    GroupGeneratorEngine,
    paper_static_schedule,
    static_schedule,
)


# ---- static schedule ---------------------------------------------------------


def test_static_schedule_paper_table():
    phase0 = {(0, 4, 8, 12), (2, 3), (6, 7), (10, 11), (14, 15), (1,), (5,), (9,), (13,)}
    intra = {(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)}
    phase2 = {(0, 3), (4, 7), (8, 11), (12, 15), (1, 9), (5, 13), (2,), (6,), (10,), (14,)}
    for period in range(3):
        for phase, expected in enumerate([phase0, intra, phase2, intra]):
            step = 4 * period + phase
            got = {tuple(paper_static_schedule(r, step, 16, 4)) for r in range(16)}
            assert got == expected, (step, got)
    assert paper_static_schedule(5, 2, 16, 4) == [5, 13]
    assert isinstance(paper_static_schedule(0, 0, 1, 1), list)


def test_static_schedule_groups_the_tables_idle_ranks_across_nodes():
    """The schedule the algorithm runs: the paper's groups, and the ranks the
    table leaves alone in phases 0 and 2 averaging with their counterparts
    on the other nodes."""
    phase0 = {(0, 4, 8, 12), (2, 3), (6, 7), (10, 11), (14, 15), (1, 5, 9, 13)}
    intra = {(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)}
    phase2 = {(0, 3), (4, 7), (8, 11), (12, 15), (1, 9), (5, 13), (2, 6, 10, 14)}
    for phase, expected in enumerate([phase0, intra, phase2, intra]):
        assert {tuple(static_schedule(r, phase, 16, 4)) for r in range(16)} == expected, phase
    assert static_schedule(5, 2, 16, 4) == [5, 13]
    assert isinstance(static_schedule(0, 0, 1, 1), list)
    # One rank per node: matchings between the global groups.
    assert {tuple(static_schedule(r, 1, 5, 1)) for r in range(5)} == {(0, 1), (2, 3), (4,)}
    assert {tuple(static_schedule(r, 3, 4, 1)) for r in range(4)} == {(0, 3), (1, 2)}


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 0, 4, 2), "rank must be in [0, world_size = 4), got 4"),
        ((-1, 0, 4, 2), "got -1"),
        ((0, -1, 4, 2), "step must be >= 0, got -1"),
        ((0, 0, 0, 2), "world_size must be >= 1, got 0"),
        ((0, 0, 4, 0), "local_size must be >= 1, got 0"),
        ((0.5, 0, 4, 2), "rank must be an int, got 0.5"),
        ((True, 0, 4, 2), "rank must be an int, got True"),
        ((0, "1", 4, 2), "step must be an int, got '1'"),
    ],
)
def test_static_schedule_argument_errors(args, message):
    with pytest.raises(ValueError) as info:
        static_schedule(*args)
    assert message in str(info.value)


def test_static_schedule_numpy_ints():
    assert static_schedule(np.int64(1), np.int32(2), 16, 4) == [1, 9]
    assert paper_static_schedule(np.int64(1), np.int32(2), 16, 4) == [1, 9]


def replay_distance(world_size, local_size, steps=40, dim=256, seed=0, schedule=static_schedule):
    """||X - mean||_F after `steps` serial steps over the start's."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((world_size, dim))
    start = np.linalg.norm(x - x.mean(axis=0))
    for step in range(steps):
        for group in _groups(schedule, step, world_size, local_size):
            x[list(group)] = x[list(group)].mean(axis=0)
    return np.linalg.norm(x - x.mean(axis=0)) / start


def _groups(schedule, step, world_size, local_size):
    """The step's groups with company, each once."""
    groups = {tuple(schedule(r, step, world_size, local_size)) for r in range(world_size)}
    return [g for g in groups if len(g) > 1]


# The design's figures (docs/ripples.md, 5.2): relative distance after 40 steps
# under the paper's table.
DESIGN_DISTANCE = {(16, 4): 0.017, (8, 4): 0.0012, (8, 2): 0.00056, (4, 2): 1e-6, (6, 3): 1.6e-4}


@pytest.mark.parametrize("world_size, local_size", sorted(DESIGN_DISTANCE))
def test_static_schedule_serial_replay_matches_the_design(world_size, local_size):
    paper = [replay_distance(world_size, local_size, seed=s, schedule=paper_static_schedule) for s in range(3)]
    ours = [replay_distance(world_size, local_size, seed=s) for s in range(3)]
    expected = DESIGN_DISTANCE[(world_size, local_size)]
    print(f"static {world_size}/L{local_size}: relative distance after 40 steps, the paper's table {paper}, "
          f"ours {ours} (design {expected})")
    for value, mine in zip(paper, ours):
        # Within a factor 2 of the design's figure (random starts differ).
        assert abs(math.log10(value) - math.log10(expected)) <= math.log10(2), (value, expected)
        # Putting the table's idle ranks to work never mixes less.
        assert mine <= value * 1.0001, (mine, value)


def steady_drift(schedule, world_size, local_size, steps=1500, dim=64, seed=0):
    """Serial replay where every rank adds unit noise after each step (its
    own update): the mean squared distance to the mean right after the
    noise, per coordinate, in steady state. A global average every step gives
    (n - 1) / n; no averaging grows without bound."""
    rng = np.random.default_rng(seed)
    x = np.zeros((world_size, dim))
    drift = []
    for step in range(steps):
        for group in _groups(schedule, step, world_size, local_size):
            x[list(group)] = x[list(group)].mean(axis=0)
        x += rng.standard_normal(x.shape)
        if step >= 100:
            drift.append(((x - x.mean(axis=0)) ** 2).sum(axis=1).mean() / dim)
    return float(np.mean(drift))


@pytest.mark.parametrize("world_size, local_size", [(4, 1), (4, 2), (6, 2), (6, 4), (8, 1), (8, 2), (8, 4)])
def test_static_schedule_keeps_the_nodes_together(world_size, local_size):
    """Issue 44: under the paper's table the nodes' models drift apart (its
    only links between nodes are one group of local workers 0 and pairs of
    local workers 1), and at 8 ranks on 2 nodes of 4 the second node's
    models ended 2-4 points below GradientAllReduce's on digits. The drift
    of the schedule the algorithm runs stays near random groups of 3's
    (1.04-1.23 at these world sizes); the paper's table's was 1.38-2.19."""
    paper = steady_drift(paper_static_schedule, world_size, local_size)
    ours = steady_drift(static_schedule, world_size, local_size)
    print(f"static {world_size}/L{local_size}: steady drift, the paper's table {paper:.2f}, ours {ours:.2f}")
    assert ours <= 1.3, (ours, paper)
    assert ours <= paper, (ours, paper)


def test_static_schedule_one_node_reaches_consensus():
    # One node: phases 1 and 3 average the whole node.
    assert replay_distance(4, 4, steps=2) < 1e-12


# ---- group generator engine ----------------------------------------------------


def test_engine_smart_round_trip():
    engine = GroupGeneratorEngine(4, group_size=2, mode="smart", seed=3)
    assert engine.world_size == 4 and engine.group_size == 2 and engine.mode == "smart"
    g = engine.request(0)
    assert isinstance(g, Group)
    assert 0 in g.ranks and len(g.ranks) == 2 and g.ranks == sorted(g.ranks)
    assert g.id in (1, 2)
    assert engine.executing(0) == g
    assert engine.lock_vector() == [True] * 4
    partner = [r for r in g.ranks if r != 0][0]
    assert engine.buffer(partner) == [g]
    assert engine.counters() == [1, 0, 0, 0]
    engine.complete(0, g.id)
    assert engine.executing(0) is None
    stats = engine.stats()
    assert stats == {
        "requests": 1,
        "groups": 2,
        "solo": 0,
        "mean_group_size": 2.0,
        "max_buffer_len": 1,
        "divisions": 1,
        "company": 0,
    }
    assert repr(g) == f"Group(id={g.id}, ranks={g.ranks})"
    assert hash(g) == hash(Group(g.id, list(g.ranks)))
    assert not engine.drained()


def test_engine_random_waits_and_polls():
    engine = GroupGeneratorEngine(3, group_size=3, mode="random")
    g1 = engine.request(0)
    assert g1.ranks == [0, 1, 2]
    engine.complete(0, g1.id)
    assert engine.request(0) is None  # 1 and 2 still hold g1
    assert engine.poll(0) is None
    assert engine.waiting() == [0]
    assert [p.ranks for p in engine.pending()] == [[0, 1, 2]]
    for r in (1, 2):
        assert engine.request(r) == g1
        engine.complete(r, g1.id)
    g2 = engine.poll(0)
    assert g2.id == 2 and g2.ranks == [0, 1, 2]
    assert engine.waiting() == []


def test_engine_leave_drain_done():
    engine = GroupGeneratorEngine(3, group_size=3)
    g = engine.request(0)
    engine.complete(0, g.id)
    engine.leave(1)
    assert engine.has_left(1)
    assert engine.request(1) == g
    engine.complete(1, g.id)
    assert engine.request(1) is GroupGeneratorEngine.DONE
    assert engine.request(1) is GroupGeneratorEngine.DONE
    assert repr(GroupGeneratorEngine.DONE) == "GroupGeneratorEngine.DONE"
    assert engine.request(2) == g
    engine.complete(2, g.id)
    assert engine.drained() and engine.outstanding_groups() == 0
    assert 1 not in engine.request(0).ranks


def test_engine_inter_intra_two_groups_per_rank():
    engine = GroupGeneratorEngine(8, group_size=3, local_size=4, inter_intra=True, seed=1)
    first = engine.request(0)
    assert len(engine.buffer(0)) == 1
    intra = engine.buffer(0)[0]
    assert intra.ranks == [0, 1, 2, 3] and intra.id > first.id
    assert engine.stats()["max_buffer_len"] == 2


def _straggler_alone_while_fast_ranks_busy(company_every):
    """Ranks 0 and 1 run three requests ahead of rank 2 (threshold 2), then
    both execute a group when rank 2 requests: rank 2's group."""
    engine = GroupGeneratorEngine(3, group_size=3, slowdown_threshold=2, seed=5,
                                  company_every=company_every)
    first = engine.request(2)  # {0, 1, 2}; rank 2 keeps executing it
    for _ in range(3):
        for r in (0, 1):
            engine.complete(r, engine.request(r).id)
    engine.complete(2, first.id)
    fast = engine.request(0)
    assert fast.ranks == [0, 1] and engine.request(1) == fast  # rank 2 filtered out
    return engine, fast, engine.request(2)


def test_engine_bounded_isolation_gives_a_straggler_company():
    engine, fast, g = _straggler_alone_while_fast_ranks_busy(company_every=1)
    assert engine.counters() == [4, 4, 2]
    assert len(g.ranks) == 2 and g.ranks[1] == 2 and g.id > fast.id
    companion = g.ranks[0]
    assert engine.buffer(companion) == [g]  # runs it at its next request
    assert engine.stats()["company"] == 1
    engine.complete(companion, fast.id)
    assert engine.request(companion) == g
    # company_every=0: the paper's rule, alone.
    engine, _, g = _straggler_alone_while_fast_ranks_busy(company_every=0)
    assert g.ranks == [2]
    assert engine.stats()["company"] == 0


def test_engine_is_deterministic():
    def run(seed):
        engine = GroupGeneratorEngine(6, group_size=3, mode="smart", seed=seed)
        out = []
        for t in range(60):
            r = (t * 5) % 6
            g = engine.request(r)
            out.append((g.id, tuple(g.ranks)))
            engine.complete(r, g.id)
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_engine_misuse_raises_value_error():
    engine = GroupGeneratorEngine(3, group_size=3, mode="random")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size = 3\), got 3"):
        engine.request(3)
    with pytest.raises(ValueError, match="rank 0 is not executing group 5"):
        engine.complete(0, 5)
    with pytest.raises(ValueError, match="rank 0 has no outstanding request"):
        engine.poll(0)
    g = engine.request(0)
    with pytest.raises(InvalidArgumentError, match=f"rank 0 is still executing group {g.id}"):
        engine.request(0)
    engine.complete(0, g.id)
    assert engine.request(0) is None
    with pytest.raises(ValueError, match="rank 0 already has an outstanding request"):
        engine.request(0)
    with pytest.raises(ValueError, match="rank must be an int, got '1'"):
        engine.leave("1")
    with pytest.raises(ValueError, match="group_id must be >= 0, got -1"):
        engine.complete(0, -1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size must be >= 1, got 0"),
        (dict(world_size=2.0), "world_size must be an int, got 2.0"),
        (dict(world_size=4, group_size=1), "group_size must be >= 2, got 1"),
        (dict(world_size=4, group_size=True), "group_size must be an int, got True"),
        (dict(world_size=4, mode="static"), "mode must be one of random, smart, got 'static'"),
        (dict(world_size=4, slowdown_threshold=0), "slowdown_threshold must be >= 1, got 0"),
        (
            dict(world_size=4, mode="random", slowdown_threshold=5),
            "slowdown_threshold = 5 needs mode 'smart', got mode 'random'",
        ),
        (dict(world_size=4, local_size=0), "local_size must be >= 1, got 0"),
        (dict(world_size=4, inter_intra=1), "inter_intra must be a bool, got 1"),
        (
            dict(world_size=4, mode="random", inter_intra=True),
            "inter_intra = True needs mode 'smart', got mode 'random'",
        ),
        (dict(world_size=4, seed=-1), "seed must be >= 0, got -1"),
        (dict(world_size=4, company_every=-1), "company_every must be >= 0, got -1"),
        (dict(world_size=4, company_every=1.0), "company_every must be an int, got 1.0"),
    ],
)
def test_engine_argument_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        GroupGeneratorEngine(**kwargs)
    assert message in str(info.value)


def test_engine_binding_validates_too():
    # The C++ engine checks its options itself (the service builds it from C++).
    from bagua.torch_api._core import core

    with pytest.raises(InvalidArgumentError, match="group_size must be >= 2, got 1"):
        core.GroupGeneratorEngine(4, group_size=1)
    with pytest.raises(InvalidArgumentError, match="unknown mode 'static'"):
        core.GroupGeneratorEngine(4, mode="static")
