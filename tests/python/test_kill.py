"""A dead peer is an error everywhere: SIGKILL one rank mid-training, for
each algorithm; every other rank raises a clear error within
BAGUA_COMM_TIMEOUT_S and exits, and no process is left behind."""

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


def launch(name, out_dir):
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", BAGUA_COMM_TIMEOUT_S=str(TIMEOUT_S))
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS), "train", str(out_dir), name],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_started(procs, out_dir, limit=90):
    deadline = time.monotonic() + limit
    while not all((out_dir / f"started{r}").exists() for r in range(WORLD)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError("the ranks did not all start training:\n" + logs(out_dir))
        time.sleep(0.05)


def logs(out_dir):
    return "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:]
                     for r in range(WORLD))


@pytest.mark.parametrize("name", sorted(kill_workers.ALL))
def test_killing_a_rank_is_a_clear_error_on_every_other_rank(name, tmp_path):
    procs = launch(name, tmp_path)
    wait_started(procs, tmp_path)
    time.sleep(random.uniform(0.0, 0.5))  # a random point of a step
    procs[VICTIM].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    exits = {}
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, killed + 3 * TIMEOUT_S + 30 - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{name}: rank {rank} still runs {3 * TIMEOUT_S + 30} s after the kill\n"
                                 + logs(tmp_path))
        exits[rank] = time.monotonic() - killed
    last = max(t for r, t in exits.items() if r != VICTIM)
    print(f"\n{name}: kill to last exit {last:.2f} s (per rank {exits})")
    for rank, proc in enumerate(procs):
        if rank == VICTIM:
            continue
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert proc.returncode == 3, f"{name}: rank {rank} exited with {proc.returncode}\n" + logs(tmp_path)
        failed = next(line for line in log.splitlines() if line.startswith("FAILED"))
        # P-Reduce spreads the failure through the groups: a rank may first
        # learn of it from a group member or the generator's host that stopped
        # because of the victim; its error names that rank and the group.
        via_group = name.startswith("partial_allreduce") and (
            "host (rank 0)" in failed or ("partial_allreduce of group" in failed and "from rank" in failed))
        assert f"rank {VICTIM}" in failed or "bucket" in failed or via_group, f"{name}: rank {rank}: {failed}"
    assert last <= TIMEOUT_S + 10, f"{name}: the last rank exited {last:.1f} s after the kill\n" + logs(tmp_path)
