"""QAdam after the warmup: the frozen second moment never lets a step exceed
Adam's own bound, so QAdam trains like Adam at every world size, with short
warmups too, and says when the warmup was too short.

The failure this guards against: a coordinate with no gradient during the
warmup (a ReLU unit dead then) freezes with v = 0; once its gradient appears
the step m / (sqrt(v) + eps) is ~1e5 x lr, and the digits MLP ended at 10 %
accuracy (NaN weights) with warmup_steps=20 or 2 at world 2 and 3, with or
without compression."""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from launcher import free_port

from bagua.torch_api.algorithms import q_adam

ROOT = Path(__file__).resolve().parents[2]


def test_a_coordinate_silent_during_warmup_takes_a_bounded_step():
    lr, warmup = 0.01, 2
    p = torch.nn.Parameter(torch.tensor([0.25, 0.25]))
    optimizer = q_adam.QAdamOptimizer([p], lr=lr, warmup_steps=warmup)
    for _ in range(warmup):  # only the first coordinate has a gradient
        p.grad = torch.tensor([1e-3, 0.0])
        optimizer.step()
    assert optimizer.state[p]["exp_avg_sq"][1] == 0.0
    # After the warmup the algorithm averages the momentum; here: the second
    # coordinate's gradient appears (and quantization noise could do the same).
    before = p.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            optimizer.state[p]["exp_avg"].mul_(0.9).add_(torch.tensor([1e-3, 1e-4]), alpha=0.1)
            optimizer.step()
    moved = (p.detach() - before).abs()
    assert torch.isfinite(p).all()
    # Adam's bound on one step is lr * (1 - b1) / sqrt(1 - b2) / bias corrections:
    # a few lr, never 1e5 lr.
    assert moved[1] <= 5 * 10 * lr, moved


def test_the_floor_is_adams_invariant():
    torch.manual_seed(0)
    beta1, beta2 = 0.9, 0.999
    m = torch.zeros(1000, dtype=torch.float64)
    v = torch.zeros(1000, dtype=torch.float64)
    worst = 0.0
    for step in range(1, 300):
        g = torch.randn(1000, dtype=torch.float64) * torch.rand(1000, dtype=torch.float64) ** 8  # heavy tails, near-zero coordinates
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        c = q_adam.adam_second_moment_floor(beta1, beta2, step)
        worst = max(worst, float((c * m * m / v).max()))
    assert worst <= 1 + 1e-9  # Adam itself never goes below the floor (equal at step 1)
    assert q_adam.adam_second_moment_floor(0.0, 0.5, 7) == pytest.approx(0.5)
    assert q_adam.adam_second_moment_floor(0.9, 0.0, 7) == 0.0
    assert q_adam.adam_second_moment_floor(0.99, 0.9, 10 ** 6) == 0.0


def run_digits(tmp_path, world, algorithm, *args):
    results = tmp_path / f"{algorithm}-{world}-{'_'.join(args)}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node", str(world),
         "--master_port", str(free_port()), str(ROOT / "examples" / "digits_mlp.py"),
         "--algorithm", algorithm, "--results", str(results), *args],
        timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results.read_text()), proc.stderr


@pytest.mark.parametrize("world", [3])  # odd: chunks of unequal size (2 ranks: 15-20 s more for CI)
def test_qadam_trains_like_gradient_allreduce_with_short_warmups(world, tmp_path):
    reference, _ = run_digits(tmp_path, world, "gradient_allreduce")
    # --flat: the momentum is compressed among all ranks (C_LP_S, chunk = bucket / world).
    metrics, log = run_digits(tmp_path, world, "qadam", "--flat", "--warmup-steps", "20")
    print(f"world {world}: gradient_allreduce {reference['test_accuracy']:.4f}, "
          f"qadam warmup 20 {metrics['rank_accuracies']}")
    for accuracy in metrics["rank_accuracies"]:
        assert accuracy >= reference["test_accuracy"] - 0.015, (metrics, reference)
    assert "warmup_steps=20 is too short" in log
    metrics, log = run_digits(tmp_path, world, "qadam", "--flat", "--warmup-steps", "2")
    print(f"world {world}: qadam warmup 2 {metrics['rank_accuracies']}")
    for accuracy in metrics["rank_accuracies"]:
        assert math.isfinite(accuracy) and accuracy >= reference["test_accuracy"] - 0.03, metrics
    assert "warmup_steps=2 is too short" in log
