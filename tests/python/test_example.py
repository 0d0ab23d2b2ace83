"""The digits example trains to >= 95 % test accuracy on 4 CPU workers,
launched through bagua's launcher, and every rank ends with the same model."""

import json
import subprocess
import sys
from pathlib import Path

from launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_example(tmp_path, algorithm, nproc=4, epochs=30):
    results = tmp_path / f"{algorithm}.json"
    subprocess.run(
        [sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node", str(nproc),
         "--master_port", str(free_port()), str(ROOT / "examples" / "digits_mlp.py"),
         "--algorithm", algorithm, "--epochs", str(epochs), "--results", str(results)],
        check=True, timeout=600, cwd=ROOT)
    return json.loads(results.read_text())


def test_digits_gradient_allreduce_reaches_95_percent(tmp_path):
    metrics = run_example(tmp_path, "gradient_allreduce")
    assert metrics["world_size"] == 4
    assert metrics["test_accuracy"] >= 0.95, metrics
    assert len(set(metrics["rank_accuracies"])) == 1, metrics
