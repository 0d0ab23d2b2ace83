"""A dead peer is an error everywhere: SIGKILL one rank mid-training, for
each algorithm; every other rank raises a clear error within
BAGUA_COMM_TIMEOUT_S and exits, and no process is left behind. For the
P-Reduce (Ripples) every survivor's error names the dead rank, and all of
them fail within half the timeout, whether or not they shared a group with
it."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import free_port

WORKERS = Path(__file__).with_name("kill_workers.py")
sys.path.insert(0, str(WORKERS.parent))
import kill_workers  # noqa: E402

TIMEOUT_S = 10  # BAGUA_COMM_TIMEOUT_S
WORLD, VICTIM = 3, 1


def launch(name, out_dir, world=WORLD):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", BAGUA_COMM_TIMEOUT_S=str(TIMEOUT_S))
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS), "train", str(out_dir), name],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_started(procs, out_dir, limit=90):
    deadline = time.monotonic() + limit
    while not all((out_dir / f"started{r}").exists() for r in range(len(procs))):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError("the ranks did not all start training:\n" + logs(out_dir, len(procs)))
        time.sleep(0.05)


def logs(out_dir, world=WORLD):
    return "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:]
                     for r in range(world))


def kill_and_collect(name, tmp_path, world, victim):
    """Trains ``name`` on ``world`` ranks, SIGKILLs ``victim`` at a random
    point of a step; returns (seconds from the kill to the last survivor's
    exit, {rank: its FAILED line})."""
    procs = launch(name, tmp_path, world)
    wait_started(procs, tmp_path)
    time.sleep(random.uniform(0.0, 0.5))  # a random point of a step
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    exits = {}
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, killed + 3 * TIMEOUT_S + 30 - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{name}: rank {rank} still runs {3 * TIMEOUT_S + 30} s after the kill\n"
                                 + logs(tmp_path, world))
        exits[rank] = time.monotonic() - killed
    last = max(t for r, t in exits.items() if r != victim)
    print(f"\n{name}: kill to last exit {last:.2f} s (per rank {exits})")
    failed = {}
    for rank, proc in enumerate(procs):
        if rank == victim:
            continue
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert proc.returncode == 3, f"{name}: rank {rank} exited with {proc.returncode}\n" + logs(tmp_path, world)
        failed[rank] = next(line for line in log.splitlines() if line.startswith("FAILED"))
    return last, failed


@pytest.mark.parametrize("name", sorted(kill_workers.ALL))
def test_killing_a_rank_is_a_clear_error_on_every_other_rank(name, tmp_path):
    last, failed = kill_and_collect(name, tmp_path, WORLD, VICTIM)
    for rank, line in failed.items():
        assert f"rank {VICTIM}" in line or "bucket" in line, f"{name}: rank {rank}: {line}"
    assert last <= TIMEOUT_S + 10, f"{name}: the last rank exited {last:.1f} s after the kill\n" + logs(tmp_path)


@pytest.mark.parametrize("name", ["partial_allreduce_smart", "partial_allreduce_static"])
def test_p_reduce_survivors_name_the_dead_rank_promptly(name, tmp_path):
    """Rank 2 of 4 dies: the survivors that shared no group with it learn it
    from the generator's host (smart) or a failed P-Reduce (static, whose
    error lists the lost connections), each naming rank 2, well within the
    timeout."""
    last, failed = kill_and_collect(name, tmp_path, 4, 2)
    for rank, line in failed.items():
        assert "rank 2" in line, f"{name}: rank {rank} does not name the dead rank: {line}"
    assert last <= TIMEOUT_S / 2, f"{name}: the last rank exited {last:.1f} s after the kill\n" + logs(tmp_path, 4)
