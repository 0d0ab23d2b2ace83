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
    return {"host": platform.node(), "cpu_count": os.cpu_count(), "cpu": model, "blas": blas_library()}


def blas_library() -> dict:
    """Which BLAS torch's matrix multiplies run in, and how fast one
    wide_mlp layer's forward multiply (32 x 1024 by 1024 x 1024, one
    thread) goes. On Debian, torch calls whichever libblas.so.3 the
    alternatives system (or LD_LIBRARY_PATH) selects: the netlib reference
    implementation is 10-20x slower than OpenBLAS there, which changes how
    much of a step communication is. Workers inherit the environment, so
    they load the same library."""
    import ctypes
    import time

    try:
        import torch
    except ImportError:
        return {"library": "unknown (no torch)"}
    info = torch.__config__.show()
    build = next((part.split("=", 1)[1] for part in info.replace(",", " ").split()
                  if part.startswith("BLAS_INFO=")), "unknown")
    library = f"linked into torch (BLAS_INFO={build})"
    if build == "generic":  # torch calls sgemm_ from a shared library: find which
        class DlInfo(ctypes.Structure):
            _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                        ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
        torch.ones(4, 4) @ torch.ones(4, 4)  # the BLAS is loaded by now
        with open("/proc/self/maps") as maps:
            libtorch = next((line.split()[-1] for line in maps if "libtorch_cpu.so" in line), None)
        if libtorch:  # look sgemm_ up the way libtorch's own calls resolve it
            dl = DlInfo()
            try:
                address = ctypes.cast(ctypes.CDLL(libtorch).sgemm_, ctypes.c_void_p)
            except AttributeError:  # no sgemm_ in torch's scope: leave the build's name
                address = None
            if address and ctypes.CDLL("libc.so.6").dladdr(address, ctypes.byref(dl)):
                library = os.path.realpath(dl.fname.decode())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x, w = torch.randn(32, 1024), torch.randn(1024, 1024)
    x @ w.t()
    start = time.perf_counter()
    for _ in range(5):
        x @ w.t()
    seconds = (time.perf_counter() - start) / 5
    torch.set_num_threads(threads)
    return {"library": library, "sgemm_gflops_1_thread": round(2 * 32 * 1024 * 1024 / seconds / 1e9, 1)}


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


def timed_stages(model, opt, batch):
    """Seconds of one training step, by stage: forward (with the loss),
    backward (for DDP and bagua this includes waiting for the gradients'
    communication, done in autograd's end-of-backward callback), optimizer
    step (with bagua's post-step hook), and the total."""
    import time

    import torch.nn.functional as F

    x, y = batch
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}


def interleaved_steps(runs, batches, steps):
    """Times `steps` training steps of every (model, optimizer) in `runs`
    ({kind: (model, opt)}), interleaved step by step with a barrier before
    each, so drift in machine load hits every kind alike. Returns {kind:
    {stage: [seconds per step]}} with each step's maximum over ranks (the
    slowest rank sets the pace). Collective."""
    return interleaved_windows(runs, batches, steps)[0]


def interleaved_windows(runs, batches, steps, clock=None, counters=None, after_step=None):
    """As interleaved_steps, also returning each step's window on the
    timeline `clock` ({kind: [(start_us, end_us) per step, this rank]}; 0s
    without one). `counters` ({stage: fn(model)}, numbers that only grow
    unless restarted, e.g. seconds a model's ops ran) add the increase over
    each step as a stage; a restart counts all of the new value.
    `after_step(i)` runs after every kind's step i, outside the windows."""
    import torch

    import bagua.torch_api as bagua

    samples, windows = {kind: [] for kind in runs}, {kind: [] for kind in runs}
    for i in range(steps):
        batch = batches[i % len(batches)]
        for kind, (model, opt) in runs.items():
            bagua.barrier()
            before = {name: fn(model) for name, fn in (counters or {}).items()}
            start_us = clock.now_us() if clock else 0
            row = timed_stages(model, opt, batch)
            windows[kind].append((start_us, clock.now_us() if clock else 0))
            for name, fn in (counters or {}).items():
                after = fn(model)
                row[name] = 0.0 if after is None else (after - before[name] if after >= before[name] else after)
            samples[kind].append(row)
        if after_step is not None:
            after_step(i)
    result = {}
    for kind, rows in samples.items():
        stages = list(rows[0])
        t = torch.tensor([[row[s] for s in stages] for row in rows], dtype=torch.float64)
        bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
        result[kind] = {s: t[:, j].tolist() for j, s in enumerate(stages)}
    return result, windows


def quantiles(values):
    """median and p90 of `values`."""
    import statistics

    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median": statistics.median(ordered), "p90": p90}


class BusyLoad:
    """`count` extra processes spinning on the CPU while the benchmark runs
    (the "busy machine" condition); a context manager."""

    def __init__(self, count: int):
        self.count = count
        self.procs = []

    def __enter__(self):
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


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


def gather_json(value):
    """[every rank's value] (JSON-serializable), on every rank. Collective."""
    import torch

    import bagua.torch_api as bagua

    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = torch.zeros(bagua.get_world_size(), dtype=torch.int64)
    sizes[bagua.get_rank()] = data.numel()
    bagua.allreduce_inplace(sizes)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = torch.empty(padded.numel() * len(sizes), dtype=torch.uint8)
    bagua.allgather(padded, gathered)
    rows = gathered.view(len(sizes), -1)
    return [json.loads(bytes(rows[r, :int(n)].tolist())) for r, n in enumerate(sizes.tolist())]


def step_window(events, start_us, end_us):
    """One training step on a rank's timeline (Chrome trace events): (the
    events that start in it, when its last gradient was marked ready, when
    its backward returned), in microseconds; None for a step without
    gradients marked ready (DDP, local)."""
    inside = [e for e in events if start_us <= e.get("ts", -1) < end_us]
    ready = [e["ts"] for e in inside if e.get("cat") == "tensor_ready"]
    backward = [e for e in inside if e.get("cat") == "phase" and e["name"] == "backward"]
    if not ready or not backward:
        return None
    return inside, max(ready), backward[-1]["ts"] + backward[-1]["dur"]


def steps_bench_main(script: str, doc: str, worker, report, default_steps: int, world_size: int = 2) -> None:
    """The main of a bench that runs ``worker(args)`` on local ranks: parses
    --world-size, --steps and --json, launches the ranks (rank 0 writes its
    JSON to --out), prints ``report(result, args)`` and saves the JSON."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=world_size)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--json", default="")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as where:
        out = Path(where) / "result.json"
        result = launch(script, args.world_size, out, ["--steps", str(args.steps)])
    report(result, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
