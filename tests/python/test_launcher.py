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


def test_baguas_launcher_options_set_the_workers_environment(monkeypatch, capsys):
    for name in ("BAGUA_DEFAULT_BUCKET_SIZE", "BAGUA_AUTOTUNE_OUTPUT", "BAGUA_AUTOTUNE_MAX_TRIALS", "BAGUA_AUTOTUNE"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    args = launch.build_torchrun_args([
        "--nproc_per_node=2", "--default_bucket_size", "4096", "--autotune_log_file=/tmp/plan.json",
        "--autotune_max_samples", "7", "--is_output_autotune_log", "--autotune_level", "2",
        "--bagua_service_port", "29501", "--report_metrics", "--host_list", "a,b", "--ssh_port", "22",
        "--autotune_sampling_confidence_time", "5", "--autotune_warmup_time", "30", "--enable_bagua_net",
        "--logdir", "logs", "train.py", "--default_bucket_size", "1"])
    assert args == ["--nproc_per_node=2", "--log_dir", "logs", "--redirects", "3", "train.py",
                    "--default_bucket_size", "1"]
    assert os.environ["BAGUA_DEFAULT_BUCKET_SIZE"] == "4096"
    assert os.environ["BAGUA_AUTOTUNE_OUTPUT"] == "/tmp/plan.json"
    assert os.environ["BAGUA_AUTOTUNE_MAX_TRIALS"] == "7"
    assert os.environ["BAGUA_AUTOTUNE"] == "1"  # level 2 runs level 1
    warnings = capsys.readouterr().err.splitlines()
    for option in ("--autotune_level 2", "--bagua_service_port", "--report_metrics", "--host_list", "--ssh_port",
                   "--autotune_sampling_confidence_time", "--autotune_warmup_time", "--enable_bagua_net"):
        assert sum(w.startswith(f"bagua.distributed.launch: {option}") for w in warnings) == 1, (option, warnings)
    assert len(warnings) == 8


@pytest.mark.parametrize("bad", [["--default_bucket_size", "big", "t.py"], ["--autotune_level", "4", "t.py"],
                                 ["--set_additional_flag", "--no_python", "t.sh"], ["--logdir"]])
def test_bad_launcher_options_are_clear_errors(bad, monkeypatch):
    monkeypatch.setenv("BAGUA_AUTOTUNE", "0")
    with pytest.raises(SystemExit):
        launch.build_torchrun_args(bad)


def test_set_additional_flag_runs_the_script_through_the_local_rank_shim():
    args = launch.build_torchrun_args(["--nproc_per_node=2", "--set_additional_flag", "t.py", "--lr", "1"])
    assert args == ["--nproc_per_node=2", "-m", "bagua.distributed.local_rank_arg", "t.py", "--lr", "1"]
    args = launch.build_torchrun_args(["--nproc_per_node=2", "-m", "--set_additional_flag", "pkg.train"])
    assert args == ["--nproc_per_node=2", "-m", "bagua.distributed.local_rank_arg", "--module", "pkg.train"]


def test_run_is_the_launcher():
    from bagua.distributed import run
    assert run.main is launch.main


def test_launchers_pass_local_rank_and_write_logs(tmp_path, launcher="bagua.distributed.run"):
    """End to end, 2 processes, through bagua.distributed.run (the same
    main): --set_additional_flag gives each script its --local_rank,
    --logdir keeps each rank's output in files under DIR."""
    import subprocess
    import sys
    from launcher import free_port
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint('argv', sys.argv[1:], 'rank', os.environ['RANK'], flush=True)\n")
    logs = tmp_path / "logs"
    subprocess.run([sys.executable, "-m", launcher, "--nproc_per_node", "2", "--master_port", str(free_port()),
                    "--set_additional_flag", "--logdir", str(logs), str(script), "--x", "1"],
                   check=True, timeout=120, cwd=tmp_path)
    outputs = sorted(p.read_text() for p in logs.rglob("stdout.log"))
    assert outputs == ["argv ['--local_rank=0', '--x', '1'] rank 0\n", "argv ['--local_rank=1', '--x', '1'] rank 1\n"]


def test_help_lists_baguas_options_then_torchruns(capsys):
    try:
        launch.main(["--help"])
    except SystemExit as e:  # torch 1.13 exits; torch 2's torchrun returns after help
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert "--set_additional_flag" in out and "--default_bucket_size" in out  # ours
    assert "--max_restarts" in out  # torchrun's


def test_the_agent_watches_its_workers_every_tenth_of_a_second(monkeypatch):
    monkeypatch.delenv("PET_MONITOR_INTERVAL", raising=False)
    assert launch.with_prompt_monitoring(["--nproc_per_node=2", "t.py"]) == [
        "--monitor_interval=0.1", "--nproc_per_node=2", "t.py"]
    given = ["--monitor-interval", "2", "t.py"]
    assert launch.with_prompt_monitoring(given) == given
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "3")
    assert launch.with_prompt_monitoring(["t.py"]) == ["t.py"]
