"""Float16GradAlgorithm ("floatgrad") against PyTorch DDP with
fp16_compress_hook: 10 steps of SGD with momentum and of Adam at 1 to 4
ranks, flat, hierarchical, unflattened, summing (against the hook without
its division) and built by name. Bit for bit at 1 and 2 ranks, where the
float16 sum of the ranks' values has one order; within float16's rounding
beyond, where Gloo's ring and bagua's collective add in different orders.
And what Float16 refuses."""

from pathlib import Path

import pytest
import torch

from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.bytegrad import Float16GradAlgorithm
from floatgrad_workers import VARIANTS
from launcher import run_workers

WORKERS = Path(__file__).with_name("floatgrad_workers.py")
KINDS = ("sgd", "adam")


def test_floatgrad_is_registered_with_bagua_s_defaults():
    assert GlobalAlgorithmRegistry.get("floatgrad") is Float16GradAlgorithm
    algorithm = Algorithm.init("floatgrad")
    assert type(algorithm) is Float16GradAlgorithm
    assert algorithm.hierarchical is True and algorithm.average is True
    algorithm = Algorithm.init("floatgrad", hierarchical=False, average=False)
    assert algorithm.hierarchical is False and algorithm.average is False


def assert_same_params(ours, theirs, exact, what):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if exact:
            assert torch.equal(a, b), f"{what}: max difference {(a - b).abs().max().item()}"
        else:
            # One float16 rounding (2^-11 of a gradient) per addition and
            # step; over 10 steps the parameters move apart by about 1e-4 at
            # most (measured: 9e-5 with Adam at 3 ranks).
            torch.testing.assert_close(a, b, rtol=1e-3, atol=3e-4, msg=what)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_floatgrad_equals_ddp_with_fp16_compress_hook(world_size, tmp_path):
    # 2 ranks per "node" for the hierarchical runs; small buckets so the 6
    # parameters split into several buckets of unequal sizes.
    results = run_workers("ddp_fp16_hook", world_size, tmp_path, local_size=2, script=WORKERS,
                          extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "2000"})
    exact = world_size <= 2
    for rank, result in enumerate(results):
        for kind in KINDS:
            for variant, (_, _, hook) in VARIANTS.items():
                assert result[f"ops/{kind}/{variant}"] == ["centralized_half_precision"]
                assert len(result[f"buckets/{kind}/{variant}"]) > 1
                assert_same_params(result[f"bagua/{kind}/{variant}"], result[f"ddp/{kind}/{hook}"], exact,
                                   f"rank {rank} {kind} {variant} against DDP's {hook} hook")
                # every rank holds the same model
                assert_same_params(result[f"bagua/{kind}/{variant}"], results[0][f"bagua/{kind}/{variant}"],
                                   True, f"rank {rank} {kind} {variant} against rank 0")
            if world_size == 2:
                # float16 shows: full precision would not have DDP fp16's bits
                assert any(not torch.equal(a, b) for a, b in
                           zip(result[f"ddp/{kind}/fp32"], result[f"bagua/{kind}/flat"]))


def test_float16_refuses_integer_and_bfloat16_buckets_clearly(tmp_path):
    results = run_workers("bad_input", 2, tmp_path, script=WORKERS)
    for errors in results:
        assert errors == results[0]
        for name in ("int32", "int64"):
            assert "float16 communicates float32, float64 or float16 buckets, got " + name in errors[name]
        for name in ("bfloat16_bucket", "bfloat16_model"):
            assert "bfloat16" in errors[name] and "compression=None" in errors[name]
        assert "scattergather" in errors["scattergather"]
        assert "error_feedback needs compression='MinMaxUInt8'" in errors["error_feedback"]
        assert "'Float8'" in errors["unknown"] and "'Float16'" in errors["unknown"]
        for name in ("float32", "float64", "float16"):
            assert errors[name] is None, errors[name]
