"""The launcher's defaults and argument handling."""

import os

from bagua.distributed import launch


def test_nproc_per_node_defaults_to_cpu_count_without_gpu():
    args = launch.build_torchrun_args(["train.py", "--lr", "0.1"])
    assert args[0] == f"--nproc_per_node={len(os.sched_getaffinity(0))}"
    assert args[1:] == ["train.py", "--lr", "0.1"]


def test_explicit_nproc_per_node_is_kept():
    for given in (["--nproc_per_node", "3", "t.py"], ["--nproc-per-node=3", "t.py"]):
        assert launch.build_torchrun_args(given) == given


def test_script_arguments_are_not_mistaken_for_launcher_options():
    args = launch.build_torchrun_args(["t.py", "--nproc_per_node", "9"])
    assert args[0].startswith("--nproc_per_node=") and args[1:] == ["t.py", "--nproc_per_node", "9"]


def test_autotune_level_sets_the_workers_environment(monkeypatch):
    monkeypatch.delenv("BAGUA_AUTOTUNE", raising=False)
    args = launch.build_torchrun_args(["--autotune_level", "1", "--nproc_per_node=2", "t.py", "--autotune_level", "7"])
    assert args == ["--nproc_per_node=2", "t.py", "--autotune_level", "7"]
    import os

    assert os.environ["BAGUA_AUTOTUNE"] == "1"
