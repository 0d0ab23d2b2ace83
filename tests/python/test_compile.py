"""torch.compile of a module wrapped by bagua (and bagua wrapping a compiled
module): every algorithm trains as it does eagerly, Dynamo compiles only in
the first steps, GradientAllReduce equals compiled DDP, and the backward
still overlaps communication (the forward is cut into graphs of about a
bucket, as Dynamo does for DDP). Needs PyTorch 2 (skipped on 1.x)."""

import pytest
import torch

from launcher import run_workers

pytest.importorskip("torch._dynamo", reason="torch.compile needs PyTorch 2")
SCRIPT = __import__("pathlib").Path(__file__).with_name("compile_workers.py")

DETERMINISTIC = ["gradient_allreduce", "bytegrad", "qadam", "powersgd", "decentralized",
                 "low_precision_decentralized", "partial_allreduce"]


def _close(ours, theirs, rtol, what):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=what)


@pytest.mark.parametrize("order", ["wrap_then_compile", "compile_then_wrap"])
def test_every_algorithm_compiled_equals_eager(order, tmp_path):
    names = DETERMINISTIC + ["async"]
    results = run_workers("algorithms", 2, tmp_path, script=SCRIPT, timeout=600,
                          args=(order, ",".join(names), "50"))
    for rank, result in enumerate(results):
        for name in names:
            steps = result[f"{name}/compiling_steps"]
            # compiled at step 0, at most once more (the buckets re-planned
            # after the profiled first step, or the algorithm's phase change)
            assert steps and steps[0] == 0 and len(steps) <= 2, f"rank {rank} {name}: compiled at steps {steps}"
            if name == "async":  # averaging rounds follow timing: trained, and close after the last average
                _close(result[f"{name}/compiled"], results[0][f"{name}/compiled"], 1e-5, f"async rank {rank}")
                continue
            _close(result[f"{name}/compiled"], result[f"{name}/eager"], 1e-5, f"rank {rank} {name} {order}")


def test_gradient_allreduce_compiled_equals_compiled_ddp(tmp_path):
    results = run_workers("versus_ddp", 2, tmp_path, script=SCRIPT, timeout=600, args=("inductor", "10"))
    for rank, result in enumerate(results):
        _close(result["bagua"], result["ddp"], 1e-6, f"rank {rank}")


def test_compiled_backward_overlaps_communication(tmp_path):
    """With the cut, the gradients of six 768x768 layers become ready over
    the backward's duration; without it (optimize_ddp off), all at once."""
    env = {"BAGUA_DEFAULT_BUCKET_SIZE": str(768 * 768 * 4 + 768 * 4)}
    spread = {}
    for split in ("1", "0"):
        results = run_workers("ready_spread", 2, tmp_path / split, script=SCRIPT, timeout=600,
                              extra_env=env, args=(split,))
        spread[split] = min(min(r["spreads"]) for r in results)
    print("ready spread (s), split and one graph:", spread)
    assert spread["1"] > 5 * spread["0"], spread
