"""algorithm="auto": the cost model alone (unit tests, hand-computed
values), and the algorithm on several processes: every rank makes the same
choice, the run after the choice is the chosen algorithm's, BAGUA_ALGORITHM
overrides it and must agree across ranks, a checkpoint keeps the choice."""

from pathlib import Path

import pytest
import torch

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.algorithms.auto import (CANDIDATES, AutoAlgorithm, LinkModel, Measurements, choose,
                                             measured_overlap, powersgd_plan, predict)
from launcher import run_workers

WORKERS = Path(__file__).with_name("auto_workers.py")


def measurements(**changes):
    base = dict(world_size=4, compute_s=0.1, gradient_bytes=20_000_000, buckets=2,
                allreduce=LinkModel(1e-3, 1 / 10e9), low_precision=LinkModel(2e-3, 1 / 30e9),
                powersgd_bytes=200_000, powersgd_math_s=0.02, overlap=0.5)
    base.update(changes)
    return Measurements(**base)


def test_link_model_fits_the_line_through_two_points_and_never_goes_negative():
    link = LinkModel.fit(1000, 0.002, 101000, 0.012)
    assert link.seconds_per_byte == pytest.approx(1e-7)
    assert link.latency_s == pytest.approx(0.0019)
    assert link.time(1e6, calls=3) == pytest.approx(3 * 0.0019 + 0.1)
    # a large probe faster than the small one (noise, another transport): no negative slope
    assert LinkModel.fit(1000, 0.002, 101000, 0.001) == LinkModel(0.002, 0.0)
    # a steep line through the points would cross zero: latency clamps at 0
    assert LinkModel.fit(1000, 0.0001, 2000, 0.01).latency_s == 0.0


def test_predict_by_hand():
    """Each formula of docs/auto.md on one set of numbers."""
    m = measurements()
    p = predict(m)
    hidden = 0.5 * 0.1
    assert p["gradient_allreduce"] == pytest.approx(0.1 + max(0, 2 * 1e-3 + 20e6 / 10e9 - hidden))
    assert p["bytegrad"] == pytest.approx(0.1 + max(0, 2 * 2e-3 + 20e6 / 30e9 - hidden))
    # one bucket after backward: two exchanges, nothing hidden
    assert p["powersgd"] == pytest.approx(0.1 + 0.02 + 2 * 1e-3 + 2e5 / 10e9)
    assert p["powersgd_8bit"] == pytest.approx(0.1 + 0.02 + 2 * 2e-3 + 2e5 / 30e9)
    # nothing to hide it behind: the whole communication shows
    assert predict(measurements(overlap=0.0))["gradient_allreduce"] == pytest.approx(0.1 + 2e-3 + 2e-3)
    assert set(predict(measurements(world_size=1)).values()) == {0.1}


def test_overlap_is_what_the_backward_pass_hid():
    # 60 ms of allreduces, 20 ms still waited for after a 100 ms backward: 40 ms hidden
    assert measured_overlap(0.06, 0.02, 0.1) == pytest.approx(0.4)
    assert measured_overlap(0.06, 0.08, 0.1) == 0.0  # waited longer than predicted: nothing hidden
    assert measured_overlap(0.5, 0.0, 0.1) == 1.0
    assert measured_overlap(0.5, 0.0, 0.0) == 0.0


def test_choice_follows_the_network():
    fast = measurements()  # 10 GB/s: the gradient hides behind backward; PowerSGD's math does not
    assert choose(predict(fast), CANDIDATES) == "gradient_allreduce"
    slow = measurements(allreduce=LinkModel(1e-3, 1 / 12.5e6), low_precision=LinkModel(2e-3, 1 / 40e6))
    assert choose(predict(slow), CANDIDATES) == "powersgd_8bit"  # 3.2x fewer seconds per byte here
    assert choose(predict(slow), ["gradient_allreduce", "bytegrad", "powersgd"]) == "powersgd"
    # PowerSGD not allowed: 8-bit gradients are the next best on a slow link
    assert choose(predict(slow), ["gradient_allreduce", "bytegrad"]) == "bytegrad"
    # factors as large as the gradient (nothing compressible): 8-bit gradients win
    flat = measurements(allreduce=LinkModel(1e-3, 1 / 12.5e6), low_precision=LinkModel(2e-3, 1 / 40e6),
                        powersgd_bytes=20_000_000)
    assert choose(predict(flat), CANDIDATES) == "bytegrad"


def test_powersgd_plan_counts_factors_and_uncompressed_tensors():
    shapes = [torch.Size([2048, 512]), torch.Size([2048]), torch.Size([10, 2048]), torch.Size([3, 3])]
    # (2048 + 512) * r + 2048 + (10 + 2048) * r + 9 (a 3 x 3 matrix does not shrink)
    assert powersgd_plan(shapes, 1) == 4 * (2560 + 2048 + 2058 + 9)
    assert powersgd_plan(shapes, 2) == 4 * (2 * 2560 + 2048 + 2 * 2058 + 9)


@pytest.mark.parametrize("bad", [dict(candidates=[]), dict(candidates="powersgd"), dict(candidates=["ddp"]),
                                 dict(decide_after=0), dict(powersgd_rank=0), dict(overlap=1.5),
                                 dict(overlap="all")])
def test_bad_arguments_are_clear_errors(bad):
    with pytest.raises(InvalidArgumentError):
        AutoAlgorithm(**bad)


def _check_same_run(results):
    """Every rank made the same choice at the same step; replicas agree; the
    run equals the chosen algorithm's from the start. (The measured steps ran
    GradientAllReduce: PowerSGD's first start_iter steps equal it, ByteGrad's
    do not, so a measured choice of ByteGrad is compared from rank to rank
    only.)"""
    first = results[0]
    for rank, result in enumerate(results):
        choices = [d and d["choice"] for d in result["decisions"]]
        assert choices == [d and d["choice"] for d in first["decisions"]], f"rank {rank}"
        comparable = result["decisions"][0]["choice"] == result["decisions"][-1]["choice"] if \
            result["decisions"][0] else result["decisions"][-1]["choice"] != "bytegrad"
        for step, (ours, direct, rank0) in enumerate(zip(result["auto"], result["direct"], first["auto"])):
            for a, b, c in zip(ours, direct, rank0):
                assert torch.equal(a, c), f"rank {rank} differs from rank 0 at step {step + 1}"
                if comparable:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"rank {rank}, step {step + 1}: {m}")
    return first["decisions"][-1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_measures_and_every_rank_runs_the_same_choice(tmp_path, world_size):
    results = run_workers("auto", world_size, tmp_path, script=WORKERS)
    decisions = results[0]["decisions"]
    assert decisions[0] is None and decisions[1]["choice"] in CANDIDATES  # decided after step 2
    decision = _check_same_run(results)
    assert decision["reason"] == "least predicted step time"
    assert set(decision["predicted_step_s"]) == set(CANDIDATES)
    assert decision["choice"] == min(CANDIDATES, key=decision["predicted_step_s"].get)
    m = decision["measurements"]
    assert m["world_size"] == world_size and m["compute_s"] > 0 and m["allreduce"]["latency_s"] >= 0
    assert 0 <= m["overlap"] <= 1
    assert all(r["decisions"][-1] == decision for r in results)  # measurements agreed exactly


@pytest.mark.parametrize("override", ["bytegrad", "powersgd_8bit"])
def test_bagua_algorithm_overrides_the_choice(tmp_path, override):
    results = run_workers("auto", 3, tmp_path, script=WORKERS, args=(override,))
    assert [d["choice"] for d in results[0]["decisions"]] == [override] * 6
    assert results[0]["decisions"][0]["reason"] == "BAGUA_ALGORITHM"
    assert results[0]["current"] == {"bytegrad": "ByteGradAlgorithmImpl",
                                     "powersgd_8bit": "PowerSGDAlgorithmImpl"}[override]
    assert results[0]["state_choice"] == override
    _check_same_run(results)


def test_bagua_algorithm_differing_between_ranks_is_an_error_on_every_rank(tmp_path):
    results = run_workers("override_mismatch", 3, tmp_path, script=WORKERS)
    for rank, result in enumerate(results):
        assert result["error"] is not None and "BAGUA_ALGORITHM" in result["error"], f"rank {rank}"


def test_invalid_bagua_algorithm_names_the_variable(tmp_path):
    with pytest.raises(AssertionError, match="BAGUA_ALGORITHM"):
        run_workers("auto", 2, tmp_path, script=WORKERS, extra_env={"BAGUA_ALGORITHM": "fastest"})


def test_a_checkpoint_keeps_the_choice(tmp_path):
    results = run_workers("resume", 2, tmp_path, script=WORKERS)
    assert all(r["choice"] == "bytegrad" and r["current"] == "ByteGradAlgorithmImpl" for r in results)
