"""Helpers shared by the benchmark scripts: start N local worker processes
as torchrun would, and describe the machine."""

import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, world_size: int, out: Path, worker_args, local_size: int = 0) -> dict:
    """Runs `script --worker --out OUT worker_args...` on `world_size` ranks
    (`local_size` ranks per simulated node, default all); returns the JSON
    rank 0 wrote to OUT."""
    port = free_port()
    procs = []
    local_size = local_size or world_size
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local_size),
                   LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, script, "--worker", "--out", str(out), *worker_args]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"benchmark worker failed on world size {world_size}")
    return json.loads(out.read_text())


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpu_count": os.cpu_count(), "cpu": model}


def timed_steps(model, opt, data, steps):
    """Seconds of each of `steps` training steps (zero_grad, forward,
    backward, optimizer step) on batches taken in turn from `data`."""
    import time

    import torch.nn.functional as F

    times = []
    for i in range(steps):
        x, y = data[i % len(data)]
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def median_slowest(samples):
    """{name: [step seconds]} -> {name: median over steps of the slowest
    rank's time}. Collective: every rank calls it with its own samples."""
    import statistics

    import torch

    import bagua.torch_api as bagua

    summary = {}
    for name, times in samples.items():
        t = torch.tensor(times, dtype=torch.float64)
        bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
        summary[name] = statistics.median(t.tolist())
    return summary
