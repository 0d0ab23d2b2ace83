"""Inputs of different lengths per rank (rank r: 4 + 2r batches) inside
``join()``: GradientAllReduce equal to DDP's ``join()`` (both choices of
``divide_by_initial_world_size``, gradient accumulation with ``no_sync``,
and two models in one join), every other algorithm finishing without a hang
with equal replicas where it promises them; and without ``join()``, an
error that names it (join_workers.py has the loops)."""

import pytest
import torch

from launcher import run_workers

SCRIPT = __import__("pathlib").Path(__file__).with_name("join_workers.py")
SHARED = ["bytegrad", "floatgrad", "qadam", "powersgd", "auto"]
LOCAL = ["decentralized", "low_precision_decentralized", "async", "partial_allreduce"]
ENV = {"BAGUA_COMM_TIMEOUT_S": "30"}


def _close(a, b, msg):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_allreduce_join_equals_ddp(world_size, tmp_path):
    results = run_workers("uneven", world_size, tmp_path, script=SCRIPT, extra_env=ENV,
                          args=("gradient_allreduce", "True,False"))
    for rank, result in enumerate(results):
        for key in ("True", "False"):
            for part in ("weights", "buffers"):
                for i, (a, b) in enumerate(zip(result[f"gradient_allreduce/{key}"][part], result[f"ddp/{key}"][part])):
                    _close(a, b, f"rank {rank} divide_by_initial_world_size={key} {part} {i}")
        for i, (a, b) in enumerate(zip(result["accumulate/gradient_allreduce"]["weights"],
                                       result["accumulate/ddp"]["weights"])):
            _close(a, b, f"rank {rank} no_sync accumulation tensor {i}")
        # Replicas equal at the end, as DDP's.
        for a, b in zip(result["gradient_allreduce/True"]["weights"], results[0]["gradient_allreduce/True"]["weights"]):
            assert torch.equal(a, b), f"rank {rank}: replicas differ after join"


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_joins(world_size, tmp_path):
    results = run_workers("uneven", world_size, tmp_path, script=SCRIPT, extra_env=ENV,
                          args=(",".join(SHARED + LOCAL), "True"), timeout=400)
    for name in SHARED + LOCAL:
        for rank, result in enumerate(results):
            weights = result[f"{name}/True"]["weights"]
            assert all(torch.isfinite(w).all() for w in weights), f"rank {rank} {name}"
            if name in SHARED:
                for a, b in zip(weights, results[0][f"{name}/True"]["weights"]):
                    assert torch.equal(a, b), f"{name}: rank {rank}'s replica differs from rank 0's after join"


def test_bytegrad_joins_in_segments(tmp_path):
    """ByteGrad's ranks check once per op that their segments agree; under
    join() a rank out of data must run the same ops as the others (the DDP
    hook once built new ones there: a refused check, then a hang). Buckets
    of the 451-element model in segments of 100, 3 ranks."""
    results = run_workers("uneven", 3, tmp_path, script=SCRIPT, args=("bytegrad", "True"), timeout=300,
                          extra_env={**ENV, "BAGUA_LOW_PRECISION_SEGMENT": "100"})
    for rank, result in enumerate(results):
        for a, b in zip(result["bytegrad/True"]["weights"], results[0]["bytegrad/True"]["weights"]):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"rank {rank}'s replica differs after join"


def test_two_models_in_one_join(tmp_path):
    results = run_workers("gan", 3, tmp_path, script=SCRIPT, extra_env=ENV)
    for rank, result in enumerate(results):
        for m, (mine, ddp) in enumerate(zip(result["gradient_allreduce"], result["ddp"])):
            for i, (a, b) in enumerate(zip(mine, ddp)):
                _close(a, b, f"rank {rank} model {m} tensor {i}")


def test_without_join_the_error_names_it(tmp_path):
    results = run_workers("no_join", 2, tmp_path, script=SCRIPT, extra_env={"BAGUA_COMM_TIMEOUT_S": "4"})
    error = results[1]["error"]  # rank 1 has more batches: it waits in its 5th backward
    assert error is not None and "CommTimeoutError" in error, error
    assert "run out of data" in error and "model.join()" in error, error


def test_nested_joins_are_refused_and_joins_on_two_threads_are_independent(tmp_path):
    """Nested single-model joins hung until the communication timeout once
    inputs were uneven; they are refused on entry, naming the fix. Joins
    on two threads, one model each, train each model as it trains alone."""
    results = run_workers("nested_and_threads", 3, tmp_path, script=SCRIPT, extra_env=ENV, timeout=180)
    for rank, result in enumerate(results):
        error = result["nested_error"]
        assert error is not None and "InvalidArgumentError" in error and "join([" in error, error
        assert result["errors"] == [], result["errors"]
        for seed in (1, 2):
            for a, b, c in zip(result["threaded"][seed], result["alone"][seed], results[0]["threaded"][seed]):
                assert torch.equal(a, b), f"rank {rank}, model {seed}: on a thread it differs from alone"
                assert torch.equal(a, c), f"rank {rank}, model {seed}: replicas differ"
