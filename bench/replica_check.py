"""What the replica check costs: GradientAllReduce on a 4.7 M-parameter MLP
(512-1536-1536-1024-10) without the check, with check_replicas_every=100
and with it every step, three copies of one model in the same processes,
interleaved step by step with a barrier before each. The check runs once
in N steps, so the figure is the *mean* step (a median would hide it);
also the cost of one check (every step against none). Writes JSON.

    /usr/bin/python3 bench/replica_check.py [--world-size 2] [--steps 300] \
        [--json bench/results/replica_check.json]
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = [512, 1536, 1536, 1024, 10]
KINDS = {"off": 0, "every_100": 100, "every_step": 1}


def worker(args):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import Algorithm

    bagua.init_process_group()
    torch.set_num_threads(1)
    runs = {}
    for kind, every in KINDS.items():
        torch.manual_seed(0)
        layers = []
        for a, b in zip(SHAPES, SHAPES[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        runs[kind] = (model.with_bagua([opt], Algorithm.init("gradient_allreduce"), check_replicas_every=every), opt)
    g = torch.Generator().manual_seed(bagua.get_rank())
    batches = [(torch.randn(32, SHAPES[0], generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]
    times = {kind: [] for kind in runs}
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        for kind, (model, opt) in runs.items():
            bagua.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times[kind].append(time.perf_counter() - start)
        if bagua.get_rank() == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps}", flush=True)
    slowest = torch.tensor([times[k] for k in KINDS], dtype=torch.float64)
    bagua.allreduce_inplace(slowest, op=bagua.ReduceOp.MAX)
    warm = slice(5, None)
    per_kind = {k: slowest[i].tolist()[warm] for i, k in enumerate(KINDS)}
    means = {k: statistics.fmean(v) for k, v in per_kind.items()}
    result = {"world_size": bagua.get_world_size(), "parameters": sum(p.numel() for p in runs["off"][0].parameters()),
              "steps": args.steps, "mean_step_s": means,
              "median_step_s": {k: statistics.median(v) for k, v in per_kind.items()},
              "every_100_over_off": means["every_100"] / means["off"],
              "one_check_s": means["every_step"] - means["off"], "machine": common.machine()}
    if bagua.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


def report(result, args):
    means = result["mean_step_s"]
    print(f"GradientAllReduce, {result['parameters']} parameters, {args.world_size} ranks, {args.steps} steps")
    for kind in KINDS:
        print(f"  {kind:<10} mean step {means[kind] * 1e3:.2f} ms (median {result['median_step_s'][kind] * 1e3:.2f})")
    print(f"  check every 100 steps / no check (means): {result['every_100_over_off']:.4f}")
    print(f"  one check: {result['one_check_s'] * 1e3:.2f} ms")


if __name__ == "__main__":
    common.steps_bench_main(__file__, __doc__, worker, report, default_steps=300)
