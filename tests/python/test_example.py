"""The digits example trains on 4 CPU workers through bagua's launcher:
GradientAllReduce reaches >= 95 % test accuracy with every rank holding the
same model, and every other algorithm lands within 1.5 points of it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def gradient_allreduce_metrics(tmp_path_factory):
    return run_example(tmp_path_factory.mktemp("example"), "gradient_allreduce")


def test_digits_gradient_allreduce_reaches_95_percent(gradient_allreduce_metrics):
    metrics = gradient_allreduce_metrics
    assert metrics["world_size"] == 4
    assert metrics["test_accuracy"] >= 0.95, metrics
    assert len(set(metrics["rank_accuracies"])) == 1, metrics


@pytest.mark.parametrize("algorithm", [
    "bytegrad", "qadam", "low_precision_decentralized", "low_precision_decentralized_ring",
    "decentralized", "decentralized_shift_one", "decentralized_ring", "async_model_average",
    "partial_allreduce_smart", "partial_allreduce_random", "partial_allreduce_static",
    "partial_allreduce_smart_low_precision", "powersgd",
])  # "auto" trains as the algorithm it picks: test_auto.py checks that choice and its run
def test_algorithm_converges_like_gradient_allreduce(algorithm, gradient_allreduce_metrics, tmp_path):
    metrics = run_example(tmp_path, algorithm)
    reference = gradient_allreduce_metrics["test_accuracy"]
    accuracies = list(metrics["rank_accuracies"])
    if algorithm.startswith("partial_allreduce"):
        # P-Reduce ranks linger at abort: each rank's own model, before the
        # example's final average, must be as good.
        accuracies += metrics["own_model_accuracies"]
    # 450 test digits: every rank within 1.5 points of the reference. Where
    # P-Reduce picks its groups by timing ("smart": the idle ranks), each
    # run trains a different sequence of averages, so one rank's own model
    # moves by about 1 point from run to run: there the ranks' mean is held
    # to 1.5 points and each rank to 3. The 8-bit variant's mean was
    # 0.962-0.976 in 23 runs on 2 cores (quiet, or beside 2 or 4 busy
    # loops) and 0.956 once in the full suite (GA 0.976). Each P-Reduce run
    # must also show that its ranks averaged: alone, each of the 4 ranks
    # reaches only 0.938-0.956 on its shard in 30 epochs
    # (bench/digits_alone.py).
    per_rank = 0.03 if algorithm.startswith("partial_allreduce_smart") else 0.015
    assert sum(accuracies) / len(accuracies) >= reference - 0.015, (algorithm, metrics, reference)
    for accuracy in accuracies:
        assert accuracy >= reference - per_rank, (algorithm, metrics, reference)
    if algorithm.startswith("partial_allreduce"):
        groups = metrics["group_stats"]
        for executed, solo, mean_size in zip(groups["executed"], groups["executed_solo"],
                                             groups["executed_mean_group_size"]):
            assert solo <= executed / 2 and mean_size >= 1.5, (algorithm, groups)


def run_example_on_nodes(tmp_path, algorithm, nodes=2, per_node=4, epochs=30, seed=0):
    """The example on ``nodes`` simulated nodes of ``per_node`` ranks (one
    launcher per node, as on a cluster): P-Reduce's smart generator then
    alternates groups across nodes (one head each) and within them."""
    results = tmp_path / f"{algorithm}.json"
    port = free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "bagua.distributed.launch", "--nnodes", str(nodes), "--node_rank", str(node),
         "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         str(ROOT / "examples" / "digits_mlp.py"), "--algorithm", algorithm, "--epochs", str(epochs),
         "--seed", str(seed), "--results", str(results)], cwd=ROOT) for node in range(nodes)]
    for launcher in launchers:
        assert launcher.wait(timeout=600) == 0, algorithm
    return json.loads(results.read_text())


def test_smart_p_reduce_on_two_nodes_of_four_converges_like_gradient_allreduce(tmp_path):
    """World 8 as 2 nodes of 4 (inter-intra groups): every rank's own model
    after abort within 1.5 points of GradientAllReduce's at the same world on
    average and each within 3, as at world 4 (measured 2026-11-29, nine runs
    of seeds 0-3: every rank within 0.9 points)."""
    reference = run_example_on_nodes(tmp_path, "gradient_allreduce")
    metrics = run_example_on_nodes(tmp_path, "partial_allreduce_smart")
    assert reference["world_size"] == metrics["world_size"] == 8
    accuracies = list(metrics["rank_accuracies"]) + list(metrics["own_model_accuracies"])
    assert sum(accuracies) / len(accuracies) >= reference["test_accuracy"] - 0.015, (metrics, reference)
    assert min(accuracies) >= reference["test_accuracy"] - 0.03, (metrics, reference)


def test_static_p_reduce_on_two_nodes_of_four_keeps_every_rank_near_gradient_allreduce(tmp_path):
    """Issue 44: the static schedule at world 8 as 2 nodes of 4. The paper's
    table links the nodes only through two of each node's ranks, and each
    rank ended on its own last update: in this run (10 epochs, seed 2) rank
    4's own model reached 89.78 % against GradientAllReduce's 94.67 %. With
    the table's idle ranks grouped across nodes and one more period of the
    schedule for the final weights, every rank's own model must be within
    1.5 points (the schedule is deterministic: no timing-dependent slack)."""
    reference = run_example_on_nodes(tmp_path, "gradient_allreduce", epochs=10, seed=2)
    metrics = run_example_on_nodes(tmp_path, "partial_allreduce_static", epochs=10, seed=2)
    assert reference["world_size"] == metrics["world_size"] == 8
    for accuracy in list(metrics["rank_accuracies"]) + list(metrics["own_model_accuracies"]):
        assert accuracy >= reference["test_accuracy"] - 0.015, (metrics, reference)
