"""Runs a worker scenario on N local processes, as torchrun would, and
collects each rank's results.

Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
a free MASTER_PORT; a rank that fails or a run that passes `timeout` fails the
test with every rank's output attached. Ranks are forked from pre-imported
interpreters where that is equivalent (forkserver.py; BAGUA_TEST_FORKSERVER=0
starts each from scratch).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from forkserver import spawn_worker

WORKERS = Path(__file__).with_name("workers.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump_stacks_then_kill(procs) -> None:
    """SIGABRT to the processes still running (faulthandler prints their
    threads' stacks), a moment to write them, then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGABRT)
    deadline = time.monotonic() + 3
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p.kill()


def run_workers(scenario: str, world_size: int, out_dir: Path, local_size: int = None,
                timeout: float = 240, extra_env: dict = None, args=(), script: Path = WORKERS,
                may_fail=()):
    """``script``: the worker file (default workers.py), run as
    ``script SCENARIO OUT_DIR ARGS...``; each rank's output is in
    OUT_DIR/rank{RANK}.log. Ranks in ``may_fail`` (e.g. one that kills
    itself) may exit with an error; their result is None."""
    out_dir.mkdir(parents=True, exist_ok=True)
    local_size = local_size or world_size
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local_size), "LOCAL_WORLD_SIZE": str(local_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "BAGUA_COMM_TIMEOUT_S": env.get("BAGUA_COMM_TIMEOUT_S", "60"),
            # A hung rank is sent SIGABRT before it is killed: Python then
            # prints every thread's stack into its log.
            "PYTHONFAULTHANDLER": "1",
        })
        env.update(extra_env or {})
        log = open(out_dir / f"rank{rank}.log", "w")
        argv = [str(script), scenario, str(out_dir), *args]
        proc = spawn_worker(rank, argv, env, out_dir / f"rank{rank}.log")
        if proc is None:  # a fresh interpreter (see forkserver.py)
            proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _dump_stacks_then_kill([p for p, _ in procs])
            code = "timeout"
        log.close()
        if code != 0 and not (rank in may_fail and code != "timeout"):
            failed.append((rank, code))
    if failed:
        logs = "\n".join(f"--- rank {r} (result saved: {(out_dir / f'rank{r}.pt').exists()}) ---\n"
                         + (out_dir / f"rank{r}.log").read_text(errors="replace")[-6000:] for r in range(world_size))
        raise AssertionError(f"scenario {scenario} on {world_size} ranks failed: {failed}\n{logs}")
    return [None if r in may_fail and not (out_dir / f"rank{r}.pt").exists()
            else torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
