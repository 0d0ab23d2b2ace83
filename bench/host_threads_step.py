"""One rank that has the host's cores to itself: PowerSGD's step with its host
passes on one thread against the same passes on torch's thread count
(bagua_core.set_host_threads; docs/algorithms.md, PowerSGD), with the step
without communication (`local`) as the floor.

World size 1 (one process; PowerSGD's exchanges then move nothing, so what
is measured is the compute and the factor passes), torch on --threads
threads, slow_network.py's models, rank --rank after --start-iter plain
steps, one bucket (as slow_network.py and auto run PowerSGD). The three kinds train from the same weights on the same batches,
interleaved step by step; each kind's median step (after --skip-steps) and
the ratios are printed, and written as JSON (--out).

    PYTHONPATH=py:build ~/.cache/bagua/venv-torch2/bin/python bench/host_threads_step.py \\
        --model issue_mlp --threads 2 --steps 60 --out bench/results/host_threads_step.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def worker(args):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    import bagua_core
    import slow_network
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

    torch.set_num_threads(args.threads)
    bagua.init_process_group()
    batches, _ = slow_network.rank_batches(0, 1, args.batch)
    kinds = {"local": 0, "powersgd_1_thread": 1, f"powersgd_{args.threads}_threads": args.threads}
    runs = {}
    for kind, host_threads in kinds.items():
        model, opt = slow_network.make_run("local", args.rank, args.lr, args.model)
        if host_threads:
            model = model.with_bagua([opt], PowerSGDAlgorithm(rank=args.rank, start_iter=args.start_iter,
                                                                one_bucket=True))
        runs[kind] = (model, opt, host_threads)
    times = {kind: [] for kind in runs}
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        for kind, (model, opt, host_threads) in runs.items():
            bagua_core.set_host_threads(max(1, host_threads))
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times[kind].append(time.perf_counter() - start)
    result = {kind: statistics.median(t[args.skip_steps:]) for kind, t in times.items()}
    Path(args.out).write_text(json.dumps({"median_s": result, "steps_s": times}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="issue_mlp")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--start-iter", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_threads_step.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.threads < 2 or args.skip_steps >= args.steps:
        parser.error("--threads must be at least 2 and --skip-steps below --steps")
    from common import launch, machine

    worker_args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("worker", "out")]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.pop("BAGUA_HOST_THREADS", None)
        result = launch(__file__, 1, Path(tmp) / "out.json", worker_args)
    medians = result["median_s"]
    local = medians["local"]
    print(f"{args.model}, 1 rank, torch on {args.threads} threads, PowerSGD rank {args.rank}, "
          f"{args.steps} steps (median of the last {args.steps - args.skip_steps}):")
    for kind, seconds in medians.items():
        print(f"{kind:>24} {seconds * 1e3:8.1f} ms  {seconds / local:6.2f}x local")
    one, many = medians["powersgd_1_thread"], medians[f"powersgd_{args.threads}_threads"]
    print(f"PowerSGD's step on {args.threads} host threads / on 1: {many / one:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), **result}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
