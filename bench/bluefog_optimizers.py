"""BlueFog's optimizers against allreduce training on a bandwidth-limited
network: the step time of decentralized training (BlueFog paper, Fig. 12 and
Table II, reproduced as ratios on a few CPU ranks).

Each rank runs in its own network namespace, its egress shaped with tbf to
--rate Mbit/s (bench/netns.py; needs root). In the same processes, each on
its own copy of one MLP (--width, 3 layers; SGD, batch 32 of synthetic
data), interleaved step by step with a barrier before each step:

- `ddp`: PyTorch DDP on Gloo (allreduce of the gradients, overlapped with
  backward): the Horovod-style baseline;
- `bf_gradient_allreduce`: `bf.DistributedGradientAllreduceOptimizer`;
- `bf_awc_dynamic` and `bf_atc_dynamic`: `bf.DistributedAdaptWithCombineOptimizer`
  and `bf.DistributedAdaptThenCombineOptimizer` with neighbour allreduce over
  BlueFog's dynamic one-peer schedule on the exponential graph (the paper's
  setting: each step one peer out and one in, weights 1/2, set through the
  optimizer's knobs before each step as BlueFog's examples do).

A step (zero_grad, forward, backward, optimizer step, which for BlueFog's
optimizers includes waiting for their communication) is timed on every
rank; its time is the slowest rank's; reported: the median and p90 over
--steps steps and each kind's median over DDP's.

    /usr/bin/python3 bench/bluefog_optimizers.py                  # 4 and 8 ranks at 200 Mbit/s
    /usr/bin/python3 bench/bluefog_optimizers.py --sizes 8 --rate 100

Writes bench/results/bluefog_optimizers.json (or --out).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, quantiles  # noqa: E402

KINDS = ["ddp", "bf_gradient_allreduce", "bf_awc_dynamic", "bf_atc_dynamic"]


def build_model(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


def make_runs(bf, topology_util, width: int) -> dict:
    """{kind: (model, optimizer, before_step)}; before_step sets a dynamic
    optimizer's knobs for the coming step (None for the others)."""
    import torch

    runs = {}
    model = build_model(width)
    runs["ddp"] = (torch.nn.parallel.DistributedDataParallel(model),
                   torch.optim.SGD(model.parameters(), lr=0.01), None)
    model = build_model(width)
    runs["bf_gradient_allreduce"] = (model, bf.DistributedGradientAllreduceOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model=model), None)
    for kind, wrap in (("bf_awc_dynamic", bf.DistributedAdaptWithCombineOptimizer),
                       ("bf_atc_dynamic", bf.DistributedAdaptThenCombineOptimizer)):
        model = build_model(width)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                   communication_type=bf.CommunicationType.neighbor_allreduce)
        schedule = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())

        def before_step(opt=opt, schedule=schedule):
            send, recv = next(schedule)
            weight = 1.0 / (len(recv) + 1)
            opt.self_weight = weight
            opt.src_weights = {r: weight for r in recv}
            opt.dst_weights = send
        runs[kind] = (model, opt, before_step)
    return runs


def timed_step(model, opt, before_step, batch) -> float:
    import torch.nn.functional as F

    x, y = batch
    start = time.perf_counter()
    if before_step is not None:
        before_step()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def worker(args):
    import torch

    import bagua.bluefog as bf
    import bagua.torch_api as bagua
    from bagua.bluefog import topology_util

    torch.set_num_threads(1)
    bf.init()
    bf.set_topology(topology_util.ExponentialGraph(bf.size()))
    g = torch.Generator().manual_seed(bf.rank())
    batches = [(torch.randn(32, args.width, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(4)]
    runs = make_runs(bf, topology_util, args.width)
    seconds = {kind: [] for kind in runs}
    for i in range(args.warmup + args.steps):
        for kind, (model, opt, before_step) in runs.items():
            bf.barrier()
            elapsed = timed_step(model, opt, before_step, batches[i % len(batches)])
            if i >= args.warmup:
                seconds[kind].append(elapsed)
    result = {}
    for kind, times in seconds.items():
        t = torch.tensor(times, dtype=torch.float64)
        bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
        result[kind] = quantiles(t.tolist())
    if bf.rank() == 0:
        params = sum(p.numel() for p in build_model(args.width).parameters())
        Path(args.out).write_text(json.dumps({"kinds": result, "parameters": params}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8", help="world sizes, comma-separated")
    parser.add_argument("--rate", type=int, default=200, help="Mbit/s of every rank's egress")
    parser.add_argument("--width", type=int, default=512, help="the MLP's width (3 layers)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bluefog_optimizers.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from netns import emulated_hosts, launch_on_hosts

    report = {"machine": machine(), "config": vars(args), "sizes": {}}
    worker_args = ["--width", str(args.width), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            print(f"{n} ranks at {args.rate} Mbit/s, {args.steps} steps per kind ...", flush=True)
            with emulated_hosts(n, rates_mbit={r: args.rate for r in range(n)}) as hosts:
                result = launch_on_hosts(__file__, hosts, Path(tmp) / f"{n}.json", worker_args)
            report["sizes"][str(n)] = result
            kinds = result["kinds"]
            base = kinds["ddp"]["median"]
            print(f"{n} ranks, {result['parameters'] * 4 / 1e6:.1f} MB of parameters: "
                  f"{'kind':>22} {'median ms':>10} {'p90 ms':>8} {'x DDP':>7}")
            for kind in KINDS:
                k = kinds[kind]
                print(f"{'':>40} {kind:>22} {1000 * k['median']:10.1f} {1000 * k['p90']:8.1f} "
                      f"{k['median'] / base:7.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
