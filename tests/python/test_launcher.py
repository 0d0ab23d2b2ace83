"""The launcher's defaults and argument handling.

The tests fix what they depend on: the number of GPUs (through the
bagua_core call the launcher asks) and BAGUA_AUTOTUNE (through monkeypatch,
so that nothing leaks into the tests that run later)."""

import os

import bagua_core
import pytest

from bagua.distributed import launch


@pytest.fixture
def gpus(monkeypatch):
    """Sets the number of GPUs the launcher sees."""
    def set_count(count: int):
        monkeypatch.setattr(bagua_core, "cuda_device_count", lambda: count)
    return set_count


def test_nproc_per_node_defaults_to_cpu_count_without_gpu(gpus):
    gpus(0)
    args = launch.build_torchrun_args(["train.py", "--lr", "0.1"])
    assert args[0] == f"--nproc_per_node={len(os.sched_getaffinity(0))}"
    assert args[1:] == ["train.py", "--lr", "0.1"]


def test_nproc_per_node_defaults_to_the_gpu_count(gpus):
    gpus(len(os.sched_getaffinity(0)) + 5)
    args = launch.build_torchrun_args(["train.py"])
    assert args == [f"--nproc_per_node={len(os.sched_getaffinity(0)) + 5}", "train.py"]


def test_explicit_nproc_per_node_is_kept():
    for given in (["--nproc_per_node", "3", "t.py"], ["--nproc-per-node=3", "t.py"]):
        assert launch.build_torchrun_args(given) == given


def test_script_arguments_are_not_mistaken_for_launcher_options(gpus):
    gpus(0)
    args = launch.build_torchrun_args(["t.py", "--nproc_per_node", "9"])
    assert args[0].startswith("--nproc_per_node=") and args[1:] == ["t.py", "--nproc_per_node", "9"]


def test_autotune_level_sets_the_workers_environment(monkeypatch):
    # setenv first: monkeypatch then restores the variable's absence (a bare
    # delenv of an unset variable records nothing to undo).
    monkeypatch.setenv("BAGUA_AUTOTUNE", "0")
    monkeypatch.delenv("BAGUA_AUTOTUNE")
    args = launch.build_torchrun_args(["--autotune_level", "1", "--nproc_per_node=2", "t.py", "--autotune_level", "7"])
    assert args == ["--nproc_per_node=2", "t.py", "--autotune_level", "7"]
    assert os.environ["BAGUA_AUTOTUNE"] == "1"
