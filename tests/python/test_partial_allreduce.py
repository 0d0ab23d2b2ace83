"""Ripples on processes (design/ripples.md, section 5): the P-Reduce
primitive against a float64 mean, the group generator service from Python,
and PartialAllReduceAlgorithm's training invariants: I0 exclusion, I1
serialisability (lr = 0: the final weights are the serial replay of the
logged groups), I2 conservation (plain SGD: the sum of the weights moves by
exactly lr times the sum of the gradients), I3 log consistency, I4 liveness
(ranks stopping at different steps all finish)."""

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from launcher import run_workers

WORKERS = Path(__file__).with_name("partial_workers.py")


@pytest.mark.parametrize("world_size", [2, 5])
def test_primitive_matches_the_members_mean(world_size, tmp_path):
    results = run_workers("primitive", world_size, tmp_path, script=WORKERS)
    rounds = len(results[0]["rounds"])
    for i in range(rounds):
        for group in results[0]["rounds"][i]["groups"]:
            if not group:
                continue
            inputs = [results[r]["rounds"][i]["input"].double() for r in group]
            mean = sum(inputs) / len(group)
            dtype = results[group[0]]["rounds"][i]["dtype"]
            tol = {"torch.float32": 1e-6, "torch.float64": 1e-12}.get(dtype, 1e-2)
            scale = 1 + max((x.abs().max().item() if x.numel() else 0) for x in inputs)
            first = results[group[0]]["rounds"][i]["output"]
            for r in group:
                out = results[r]["rounds"][i]["output"]
                assert torch.equal(out, first), (i, r)  # bit-identical members
                if out.numel():
                    assert (out.double() - mean).abs().max().item() <= tol * scale * len(group), (i, dtype)
    for r in results:
        assert r["all_vs_allreduce"] < 1e-12
        assert all(e is not None for e in r["errors"]), r["errors"]
        assert torch.allclose(r["repeated"], torch.full((10,), (world_size - 1) / 2))


@pytest.mark.parametrize("mode,world_size", [("smart", 5), ("random", 3), ("smart", 8)])
def test_group_generator_service_from_python(mode, world_size, tmp_path):
    results = run_workers("service", world_size, tmp_path, args=(mode, "3"), script=WORKERS)
    total = sum(float(r * r) for r in range(world_size))
    assert abs(sum(r["x"][0].item() for r in results) - total) < 1e-9  # conserved
    members = {}
    for rank, r in enumerate(results):
        ids = [h[0] for h in r["history"]]
        assert ids == sorted(set(ids))
        assert len(ids) >= 10 + 5 * rank
        for gid, ranks, _, _ in r["history"]:
            assert members.setdefault(gid, ranks) == ranks
            assert rank in ranks
    for gid, ranks in members.items():  # each group ran on exactly its members
        assert all(gid in [h[0] for h in results[m]["history"]] for m in ranks)
    assert "engine" in results[0]["stats"] and results[0]["stats"]["request_latency_ms"]["p50"] >= 0
    for r in results:  # every rank, not only the host
        assert r["stats"]["max_buffer_len"] >= 1, r["stats"]


def _replay(results):
    """Serial replay, in group order, of x_G <- mean(x_G) from the start."""
    x = [r["start"].clone() for r in results]
    groups = {}
    for r in results:
        for step, gid, ranks, _, _ in r["history"]:
            groups[(gid, tuple(ranks))] = ranks
    for key in sorted(groups):
        ranks = groups[key]
        mean = sum(x[m] for m in ranks) / len(ranks)
        for m in ranks:
            x[m] = mean.clone()
    return x


def _check_logs(results):
    """I0 and I3: per rank strictly increasing ids, disjoint intervals, and
    real steps (never decreasing; the groups drained after abort, the last
    stats()["drained"] entries, carry the rank's last step); every group in
    exactly its members' logs with the same members."""
    seen = defaultdict(set)
    for rank, r in enumerate(results):
        history, drained = r["history"], r["stats"]["drained"]
        last_id, last_step, last_end = 0, 1, -1.0
        for step, gid, ranks, t0, t1 in history:
            assert rank in ranks
            assert gid > last_id and step >= last_step and t0 >= last_end, (rank, history)
            last_id, last_step, last_end = gid, step, t1
            seen[(gid, tuple(ranks))].add(rank)
        final_step = history[-1].step if history else 0
        assert all(h.step == final_step for h in history[len(history) - drained:]), (rank, drained, history)
    for (gid, ranks), who in seen.items():
        assert who == set(ranks), (gid, ranks, who)


def _executed_groups(results):
    return {(gid, tuple(ranks)) for r in results for _, gid, ranks, _, _ in r["history"] if len(ranks) > 1}


STATS = {"requests", "solo", "mean_group_size", "request_latency_ms", "max_buffer_len", "executed",
         "executed_solo", "executed_mean_group_size", "drained", "final_period", "waited_s", "reduce_s"}


def _check_stats(results, generator, overlap):
    """Every field of algorithm.stats() on every rank, after abort too."""
    for rank, r in enumerate(results):
        stats = r["stats"]
        assert STATS <= set(stats) and all(stats[k] is not None for k in STATS), (rank, stats)
        assert set(stats["request_latency_ms"]) == {"p50", "p99"}
        assert stats["executed"] == len(r["history"])
        # The static schedule has no buffer; a generator's hands out groups from one.
        assert (stats["max_buffer_len"] == 0) if generator == "static" else (stats["max_buffer_len"] >= 1)
        # Every group received was executed; at abort, with overlap, a final
        # period of 4 static-schedule groups follows (0 when a rank left first).
        # Every rank lingers here (abort's default), so with overlap all run it.
        assert stats["final_period"] == (4 if overlap == "1" else 0), (rank, stats)
        if generator != "static":
            assert stats["requests"] == stats["executed"] - stats["final_period"]
    assert ("engine" in results[0]["stats"]) == (generator != "static")


def _ring_bytes_of_the_executed_groups(results) -> float:
    """Sum over the executed groups (with company) of 2(|G| - 1) M: what a
    ring reduce-scatter + allgather among the members sends in all."""
    model_bytes = results[0]["start"].numel() * 4  # float32 weights
    return sum(2 * (len(ranks) - 1) * model_bytes for _, ranks in _executed_groups(results))


DIRECT_BYTES = 64 * 1024  # lib/comm/partial_allreduce.cc: kDirectBytes


def _bytes_of_the_executed_groups(results) -> float:
    """What the full-precision P-Reduces send in all: the ring's 2(|G| - 1) M
    per group, or, where each member sends at most DIRECT_BYTES, the direct
    exchange's |G| (|G| - 1) M (every member its whole tensor to every other)."""
    model_bytes = results[0]["start"].numel() * 4
    total = 0
    for _, ranks in _executed_groups(results):
        m = len(ranks)
        total += m * (m - 1) * model_bytes if (m - 1) * model_bytes <= DIRECT_BYTES else 2 * (m - 1) * model_bytes
    return total


def _check_communication_stats(results, expected: float, tolerance: float) -> None:
    """communication_stats() counts the P-Reduces: their executions, and the
    bytes sent match the groups executed (design section 5.7, Bytes)."""
    ops = [r["comm_stats"][0] for r in results]
    executed = [sum(1 for h in r["history"] if len(h[2]) > 1) for r in results]
    assert [op["executions"] for op in ops] == executed
    sent = sum(op["bytes_sent"] for op in ops)
    assert abs(sent - expected) <= tolerance * expected, (sent, expected)


@pytest.mark.parametrize("generator,overlap,world_size", [
    ("random", "0", 2), ("smart", "1", 4), ("random", "0", 3), ("static", "1", 5), ("smart", "1", 8),
])
def test_training_lr0_is_the_serial_replay(generator, overlap, world_size, tmp_path):
    results = run_workers("train", world_size, tmp_path, args=(generator, overlap, "0"), script=WORKERS,
                          local_size=2)
    _check_logs(results)
    replay = _replay(results)
    for rank, r in enumerate(results):
        assert (r["end"] - replay[rank]).abs().max().item() < 1e-5, rank
    assert sum(len(r["history"]) for r in results) > 0


@pytest.mark.parametrize("generator,overlap,world_size", [
    ("static", "1", 2), ("smart", "0", 3), ("random", "1", 4), ("static", "0", 4), ("smart", "0", 8),
    ("random", "1", 7),
    ("static", "1", 4),  # issue 44's case: uneven steps, then abort; each id once, increasing
])
def test_training_conserves_the_sum_of_weights(generator, overlap, world_size, tmp_path):
    lr = 0.05
    results = run_workers("train", world_size, tmp_path, args=(generator, overlap, str(lr)),
                          script=WORKERS, local_size=2)
    _check_logs(results)
    _check_stats(results, generator, overlap)
    start = sum(r["start"] for r in results)
    end = sum(r["end"] for r in results)
    grads = sum(r["grad_sum"] for r in results)
    assert (end - (start - lr * grads)).abs().max().item() < 1e-4
    # Mixing happened: most executed groups had company.
    stats = [r["stats"] for r in results]
    assert sum(s["executed"] - s["executed_solo"] for s in stats) > 0
    _check_communication_stats(results, _bytes_of_the_executed_groups(results), tolerance=0.001)


@pytest.mark.parametrize("world_size,local_size", [(4, None), (8, 4)])
def test_a_straggler_behind_the_filter_still_averages_with_others(world_size, local_size, tmp_path):
    """Bounded isolation (docs/ripples.md; design I6): the slowdown filter
    keeps the 3x slower rank out of the fast ranks' groups, and the generator
    gives it a busy companion whenever its own division would leave it
    alone, so it averages in nearly all of its training steps while the fast
    ranks keep their pace. Without the rule it had company in 43-46 % of them
    (world 4, and world 8 with inter_intra, which LOCAL_WORLD_SIZE 4 turns on)."""
    results = run_workers("straggler", world_size, tmp_path, script=WORKERS, local_size=local_size)
    _check_logs(results)
    slow = results[-1]
    training = slow["history"][:len(slow["history"]) - slow["stats"]["drained"]]
    shared = sum(1 for h in training if len(h.ranks) > 1) / len(training)
    assert shared >= 0.8, (shared, [h.ranks for h in training])
    # The fast ranks keep their pace (with inter_intra one rank of the
    # straggler's node may lose a fifth of it: it heads its node and waits in
    # inter-phase pairs, with or without the rule). Sleeping ranks on 2 cores:
    # the pace ratio sinks when the machine is slow. A full suite that took
    # 1807 s instead of 1450 measured a median 2.26x (world 4) and 1.94x
    # (world 8), the slowest fast rank 1.53x; a fast rank held to the
    # straggler's groups would run near 1x.
    fast_steps = sorted(r["steps"] for r in results[:-1])
    assert fast_steps[len(fast_steps) // 2] >= 1.8 * slow["steps"], (fast_steps, slow["steps"])
    assert fast_steps[0] >= 1.4 * slow["steps"], (fast_steps, slow["steps"])
    assert results[0]["stats"]["engine"]["company"] > 0


def test_low_precision_training_conserves_within_the_8bit_error(tmp_path):
    """MinMaxUInt8 inside the group: the sum of the weights moves by lr times
    the sum of the gradients up to the quantization error, and the members
    of each group keep agreeing (the replay of the groups then matches)."""
    lr = 0.05
    results = run_workers("train", 3, tmp_path, args=("smart", "0", str(lr), "1", "3", "1"), script=WORKERS)
    _check_logs(results)
    start = sum(r["start"] for r in results)
    end = sum(r["end"] for r in results)
    grads = sum(r["grad_sum"] for r in results)
    scale = max(r["start"].abs().max().item() for r in results)
    error = (end - (start - lr * grads)).abs().max().item()
    # Measured 0.06-0.09 with a weight scale of 3.1 (full precision: 1e-6);
    # averaging errors of the 8-bit grid, not a lost or doubled update.
    assert error < 0.1 * scale, (error, scale)
    assert sum(s["executed"] - s["executed_solo"] for s in (r["stats"] for r in results)) > 0
    # A quarter of the bytes, plus each chunk's min and max.
    _check_communication_stats(results, 0.25 * _ring_bytes_of_the_executed_groups(results), tolerance=0.15)
