"""Soak: long runs that must neither hang nor leak.

    python bench/soak.py [--world-size 3] [--steps 2000] [--cycles 200] [--json FILE]

Starts WORLD_SIZE local workers. Each one:
  1. runs CYCLES abort/resume cycles of AsyncModelAverage, training a
     different number of steps per rank in each cycle;
  2. trains STEPS steps with every algorithm in turn, sleeping a random
     0-4 ms before each step (a different draw on each rank, so the ranks
     arrive at each collective in a changing order);
  3. samples its resident memory (RSS) every STEPS / 10 steps.
Each phase's replicas are compared where the algorithm makes them equal:
every step for the synchronous algorithms, after AsyncModelAverage's final
average. The memory growth after warmup (the first fifth of the steps) is
reported per algorithm, in MiB. Every wait is bounded by
BAGUA_COMM_TIMEOUT_S (default 60 s here); a hang ends as an error.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch, machine  # noqa: E402

ALGORITHMS = ["gradient_allreduce", "bytegrad", "qadam", "decentralized", "decentralized_ring",
              "low_precision_decentralized_ring", "async_model_average", "powersgd"]
# Replicas equal after every step (bit for bit up to the reduction order).
SYNCHRONOUS = {"gradient_allreduce", "bytegrad", "qadam", "powersgd"}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make(name, model):
    import torch

    from bagua.torch_api.algorithms import async_model_average, bytegrad, decentralized, gradient_allreduce
    from bagua.torch_api.algorithms import powersgd, q_adam

    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=20)
        return opt, q_adam.QAdamAlgorithm(opt)
    return sgd, {
        "gradient_allreduce": lambda: gradient_allreduce.GradientAllReduceAlgorithm(),
        "bytegrad": lambda: bytegrad.ByteGradAlgorithm(),
        "decentralized": lambda: decentralized.DecentralizedAlgorithm(peer_selection_mode="all"),
        "decentralized_ring": lambda: decentralized.DecentralizedAlgorithm(peer_selection_mode="ring"),
        "low_precision_decentralized_ring": lambda: decentralized.LowPrecisionDecentralizedAlgorithm(
            hierarchical=False),
        "async_model_average": lambda: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=5),
        "powersgd": lambda: powersgd.PowerSGDAlgorithm(rank=2, start_iter=20),
    }[name]()


def new_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def max_difference(model) -> float:
    """The largest difference of any weight from rank 0's (0 on rank 0)."""
    import torch

    import bagua.torch_api as bagua

    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    reference = flat.clone()
    bagua.broadcast(reference, 0)
    gap = torch.tensor([float((flat - reference).abs().max())])
    bagua.allreduce_inplace(gap, op=bagua.ReduceOp.MAX)
    return float(gap)


def train_step(model, opt, x, y):
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def abort_resume_cycles(cycles, rank, log):
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    model = new_model()
    opt, algorithm = make("async_model_average", model)
    model = model.with_bagua([opt], algorithm)
    x, y = batch(rank, 0)
    start, steps, samples = time.perf_counter(), 0, []
    for cycle in range(cycles):
        for _ in range((cycle + rank) % 4 + 1):
            train_step(model, opt, x, y)
            steps += 1
        algorithm.abort(model)
        train_step(model, opt, x, y)  # training between abort and resume stays local
        steps += 1
        algorithm.resume(model)
        if cycle % max(1, cycles // 10) == 0:
            samples.append((cycle, rss_mib()))
            log(f"abort/resume cycle {cycle}/{cycles}, rss {samples[-1][1]:.1f} MiB")
    algorithm.abort(model)
    assert isinstance(algorithm, AsyncModelAverageAlgorithm)
    model.without_bagua()
    return {"cycles": cycles, "steps": steps, "seconds": time.perf_counter() - start, "rss_mib": samples}


def batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step % 50)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def soak_algorithm(name, steps, rank, log):
    import bagua.torch_api as bagua

    delays = random.Random(rank * 7919 + len(name))
    model = new_model()
    opt, algorithm = make(name, model)
    model = model.with_bagua([opt], algorithm)
    every = max(1, steps // 10)
    samples, worst_gap = [], 0.0
    start = time.perf_counter()
    for step in range(steps):
        time.sleep(delays.uniform(0.0, 0.004))
        train_step(model, opt, *batch(rank, step))
        if name in SYNCHRONOUS and step % every == every - 1:
            worst_gap = max(worst_gap, max_difference(model))
        if step % every == 0 or step == steps - 1:
            samples.append((step, rss_mib()))
            log(f"{name}: step {step + 1}/{steps}, rss {samples[-1][1]:.1f} MiB")
    if name == "async_model_average":
        algorithm.abort(model, average=True)  # one final, synchronous average
        worst_gap = max_difference(model)
    seconds = time.perf_counter() - start
    model.without_bagua()
    bagua.barrier()
    warm = [rss for step, rss in samples if step >= steps // 5]
    return {"steps": steps, "seconds": seconds, "rss_mib": samples,
            "growth_after_warmup_mib": max(warm) - warm[0] if warm else 0.0,
            "max_replica_difference": worst_gap if name in SYNCHRONOUS | {"async_model_average"} else None}


def worker(args):
    import bagua.torch_api as bagua

    bagua.init_process_group()
    rank = bagua.get_rank()

    def log(message):
        if rank == 0:
            print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)

    result = {"world_size": bagua.get_world_size(), "machine": machine(),
              "abort_resume": abort_resume_cycles(args.cycles, rank, log), "algorithms": {}}
    for name in args.algorithms:
        result["algorithms"][name] = soak_algorithm(name, args.steps, rank, log)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    parser.add_argument("--json", default="bench/results/soak.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    os.environ.setdefault("BAGUA_COMM_TIMEOUT_S", "60")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = launch(__file__, args.world_size, out,
                    ["--steps", str(args.steps), "--cycles", str(args.cycles), "--algorithms", *args.algorithms])
    print(f"abort/resume: {result['abort_resume']['cycles']} cycles, {result['abort_resume']['steps']} steps "
          f"on rank 0 in {result['abort_resume']['seconds']:.1f} s")
    print(f"{'algorithm':34s} {'steps':>6s} {'s':>7s} {'rss start':>10s} {'rss end':>8s} "
          f"{'growth':>7s} {'max diff':>9s}")
    for name, r in result["algorithms"].items():
        diff = r["max_replica_difference"]
        print(f"{name:34s} {r['steps']:6d} {r['seconds']:7.1f} {r['rss_mib'][0][1]:10.1f} "
              f"{r['rss_mib'][-1][1]:8.1f} {r['growth_after_warmup_mib']:7.2f} "
              f"{'-' if diff is None else f'{diff:.2e}':>9s}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
