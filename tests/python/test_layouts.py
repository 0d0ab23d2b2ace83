"""Memory formats: a channels_last conv net trains as DDP trains it
(GradientAllReduce equal to DDP, parameters and gradients left in
channels_last, every other algorithm without error), and a parameter that is
a strided view is refused with its name where it is
communicated itself (decentralized) (layout_workers.py)."""

import pytest
import torch

from launcher import run_workers

SCRIPT = __import__("pathlib").Path(__file__).with_name("layout_workers.py")
OTHERS = ["bytegrad", "floatgrad", "powersgd", "auto", "decentralized", "low_precision_decentralized",
          "async", "partial_allreduce"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_channels_last_equals_ddp(world_size, tmp_path):
    names = ["gradient_allreduce"] + (OTHERS if world_size == 2 else [])
    results = run_workers("channels_last", world_size, tmp_path, script=SCRIPT, args=(",".join(names),))
    for rank, result in enumerate(results):
        for a, b in zip(result["gradient_allreduce"]["weights"], result["ddp"]["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for name in names:
            assert all(result[name]["layouts"]), f"rank {rank} {name}: a weight left channels_last"
            assert all(result[name]["grads"]), f"rank {rank} {name}: a gradient is not channels_last"
            assert all(torch.isfinite(w).all() for w in result[name]["weights"]), f"rank {rank} {name}"


def test_a_strided_view_is_refused_with_its_name(tmp_path):
    for result in run_workers("strided", 2, tmp_path, script=SCRIPT):
        assert result["error"] is not None and "'weight'" in result["error"], result["error"]
        assert "strided view" in result["error"], result["error"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_gradients_equal_ddp(world_size, tmp_path):
    """Sparse embedding gradients under GradientAllReduce: DDP's weights,
    indices and values exchanged (a few rows, not the table), equal replicas
    every step; the algorithms that cannot take them refuse the model at
    with_bagua naming the parameter."""
    results = run_workers("sparse", world_size, tmp_path, script=SCRIPT)
    for rank, result in enumerate(results):
        for a, b in zip(result["gradient_allreduce"]["weights"], result["ddp"]["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        rows = result["gradient_allreduce"]["rows"]
        assert all(0 < r <= 24 + 8 for r in rows), f"rank {rank}: rows sent per step {rows}"
        # A step where one rank does not use a table: replicas still equal
        # (the check ran every step) and its rows sent that step are fewer.
        skipped = result["skip_tags"]["rows"]
        assert len(skipped) == 5 and (rank != 1 or skipped[2] < rows[2]), skipped
        for name in ("bytegrad", "floatgrad"):  # the replica check ran every step
            assert all(torch.isfinite(w).all() for w in result[name]["weights"]), name
        for name in ("qadam", "decentralized", "powersgd", "auto", "async", "partial_allreduce"):
            assert result[name] is not None and "'table.weight'" in result[name], f"{name}: {result[name]}"
