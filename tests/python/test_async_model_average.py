"""Asynchronous model average: bounded staleness, the drift figures (stats,
timeline) and the final synchronous average of abort(model, average=True)."""

from pathlib import Path

import pytest
import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.async_model_average import (DEFAULT_MAX_STALENESS_STEPS,
                                                            AsyncModelAverageAlgorithm)
from launcher import run_workers

WORKERS = Path(__file__).with_name("async_workers.py")


def run(scenario, world_size, tmp_path, *args, **kwargs):
    return run_workers(scenario, world_size, tmp_path, args=args, script=WORKERS, **kwargs)


def _check_final_average(results):
    before = results[0]["before"]
    torch.testing.assert_close(results[0]["after"][0], before.mean(0), rtol=0, atol=1e-6)
    for r in results:  # every rank holds the same model, exactly
        assert torch.equal(r["after"], results[0]["after"][0].expand_as(r["after"]))
    assert not torch.allclose(before[0], before[1])  # they differed before


def test_bounded_staleness_caps_steps_per_round_and_reports_drift(tmp_path):
    bound = 3
    results = run("bounded", 3, tmp_path / "run", str(bound),
                  extra_env={"BAGUA_TIMELINE": str(tmp_path / "timeline"), "BAGUA_LOG_LEVEL": "info"})
    for rank, r in enumerate(results):
        s = r["stats"]
        steps = 30 + 2 * rank
        assert s["max_staleness_steps"] == bound and s["steps"] == steps, s
        assert 1 <= s["steps_per_round"]["max"] <= bound, s
        assert s["rounds"] >= steps // bound - 1 and s["staleness_waits"] >= 1, s
        assert s["round_ms"]["mean"] > 0 and s["round_ms"]["max"] >= s["round_ms"]["last"] > 0, s
        assert s["max_drift"] > 0 and 0 < s["relative_drift"] < 1, s  # each rank its own data
        assert r["status"] == ["stopped"]
        # the timeline: one span per round with its figures, and the waits
        assert len(r["rounds"]) >= s["rounds"] and r["waits"], rank
        assert all(e["ph"] == "X" and e["args"]["steps"] <= bound and e["args"]["drift"] >= 0
                   for e in r["rounds"])
        assert all(e["args"]["bound"] == bound for e in r["waits"])
    _check_final_average(results)
    # the log at info: the figures, at the first round and when the rounds stop
    for rank in range(3):
        lines = [line for line in (tmp_path / "run" / f"rank{rank}.log").read_text().splitlines()
                 if f"rank {rank}: asynchronous model average of bucket" in line]
        assert any("running" in line for line in lines) and any("stopped" in line for line in lines), lines
        assert all(f"bound {bound})" in line and "drift to the average" in line for line in lines), lines


def test_unbounded_runs_ahead_and_never_waits(tmp_path):
    results = run("bounded", 2, tmp_path, "none")
    for r in results:
        s = r["stats"]
        assert s["max_staleness_steps"] is None and s["staleness_waits"] == 0, s
        assert s["steps_per_round"]["max"] > 3, s  # 30+ fast steps, rounds every 100 ms
    _check_final_average(results)


def test_a_stalled_peer_ends_the_staleness_wait_with_an_error_naming_rank_and_op(tmp_path):
    results = run("stalled_peer", 2, tmp_path, extra_env={"BAGUA_COMM_TIMEOUT_S": "2"}, timeout=90)
    r = results[0]
    assert r["error"] is not None and r["is_bagua_error"], r
    assert "rank 0" in r["error"] and "asynchronous_model_average" in r["error"], r
    assert r["seconds"] < 30, r


def test_staleness_and_abort_arguments_are_checked():
    assert AsyncModelAverageAlgorithm().max_staleness_steps == DEFAULT_MAX_STALENESS_STEPS
    assert AsyncModelAverageAlgorithm(max_staleness_steps=None).max_staleness_steps is None
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=f"max_staleness_steps.*{bad!r}"):
            AsyncModelAverageAlgorithm(max_staleness_steps=bad)
    with pytest.raises(bagua.InvalidArgumentError, match="average"):
        AsyncModelAverageAlgorithm().abort(None, average="yes")
