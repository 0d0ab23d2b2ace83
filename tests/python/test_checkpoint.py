"""Checkpoint and resume (bagua.torch_api.checkpoint): a run resumed from a
checkpoint ends with the weights of an uninterrupted run, for each
algorithm; a save killed midway leaves the previous checkpoint loadable."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bagua.torch_api as bagua
from bagua.torch_api.checkpoint import load_checkpoint
from launcher import free_port, run_workers

WORKERS = Path(__file__).with_name("checkpoint_workers.py")
sys.path.insert(0, str(WORKERS.parent))
import checkpoint_workers  # noqa: E402

# Largest difference allowed between resumed and uninterrupted weights.
# Every algorithm's state is saved, so every run is deterministic: exact.
TOLERANCE = {name: 0.0 for name in checkpoint_workers.ALGORITHMS}


def run_phase(phase, world_size, tmp_path):
    # Small buckets: several per model, planned from the profiled order.
    return run_workers("resume", world_size, tmp_path / phase, script=WORKERS, timeout=300,
                       args=(phase, str(tmp_path / "checkpoints")),
                       extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "1500"})


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(world_size, tmp_path):
    full = run_phase("full", world_size, tmp_path)
    run_phase("first", world_size, tmp_path)
    resumed = run_phase("resume", world_size, tmp_path)
    for rank in range(world_size):
        for name in checkpoint_workers.ALGORITHMS:
            assert resumed[rank][name + "/iteration"] == checkpoint_workers.SAVE_AT
            worst = max((a - b).abs().max().item() for a, b in zip(full[rank][name], resumed[rank][name]))
            assert worst <= TOLERANCE[name], f"rank {rank}, {name}: resumed weights differ by {worst}"


def test_asynchronous_averaging_leaves_the_weights_alone_while_a_checkpoint_holds_them(tmp_path):
    # Between steps the background thread applies its averages whenever the
    # weight lock is free; save_checkpoint / load_checkpoint hold it.
    for rank, result in enumerate(run_workers("hold_weights", 2, tmp_path, script=WORKERS, timeout=120)):
        assert result["free"] and result["after"], f"rank {rank}: the rounds did not run: {result}"
        assert not result["held"], f"rank {rank}: the weights changed while held"


def test_rebuilt_decentralized_ops_continue_the_communication_step(tmp_path):
    # shift_one's partners follow the step; new ops started again at 0, so
    # after a re-bucketing ranks paired as at the start of training.
    for result in run_workers("rebuild_keeps_step", 2, tmp_path, script=WORKERS, timeout=120,
                              extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "1500"}):
        assert result["before"] and set(result["before"]) == {2}, result  # steps 1 and 3
        assert set(result["after"]) == {3}, result  # and step 5


def interrupted_save(tmp_path, crash_at):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               BAGUA_COMM_TIMEOUT_S="60")
    proc = subprocess.run([sys.executable, str(WORKERS), "interrupted_save", str(tmp_path),
                           str(tmp_path / "checkpoints"), crash_at], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("crash_at", ["1", "2", "tracker"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(crash_at, tmp_path):
    interrupted_save(tmp_path, crash_at)
    torch.manual_seed(99)
    model = checkpoint_workers.Net()
    opt = checkpoint_workers.sgd(model)
    assert load_checkpoint(str(tmp_path / "checkpoints"), model, opt) == checkpoint_workers.SAVE_AT
    saved = torch.load(tmp_path / "saved_weights.pt")
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert opt.state_dict()["state"], "the optimizer's momentum was not loaded"


def test_without_a_checkpoint_load_returns_zero(tmp_path):
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    assert load_checkpoint(str(tmp_path), model) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_corrupt_tracker_is_an_invalid_argument_naming_the_file(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12abc")
    with pytest.raises(bagua.InvalidArgumentError, match="latest_checkpointed_iteration.txt"):
        load_checkpoint(str(tmp_path), torch.nn.Linear(2, 2))


RESTART_WORKER = Path(__file__).with_name("restart_worker.py")


def launch_with_restarts(tmp_path, tag, name, world_size, kill_at):
    """restart_worker.py under torchrun (bagua's launcher), --max_restarts 3."""
    out = tmp_path / tag
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", BAGUA_COMM_TIMEOUT_S="20",
               PYTHONPATH=os.pathsep.join([str(WORKERS.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node", str(world_size),
         "--max_restarts", "3", "--master_port", str(free_port()), str(RESTART_WORKER),
         str(tmp_path / f"{tag}-checkpoints"), str(out), name, str(kill_at)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("name", ["gradient_allreduce", "low_precision_decentralized"])
def test_a_rank_killed_under_torchrun_restarts_and_the_run_ends_as_if_uninterrupted(name, tmp_path):
    world_size = 2
    reference = launch_with_restarts(tmp_path, "reference", name, world_size, kill_at=0)
    restarted = launch_with_restarts(tmp_path, "killed", name, world_size, kill_at=10)
    for rank in range(world_size):
        assert restarted[rank]["restarts"] >= 1 and restarted[rank]["resumed_from"] == 8
        assert reference[rank]["restarts"] == 0 and reference[rank]["resumed_from"] == 0
        for a, b in zip(reference[rank]["weights"], restarted[rank]["weights"]):
            assert torch.equal(a, b), f"rank {rank}: {name} after the restart differs by {(a - b).abs().max()}"
