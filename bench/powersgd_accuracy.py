"""PowerSGD's accuracy against DDP's over several seeds and checkpoints
(issue 43, point 1: "accuracy within 1.5 points of DDP's").

One seed's accuracy after 40 steps on digits' 450 test images moves by
whole points between seeds (one image is 0.22 points), so a single run
cannot tell a 1.8-point gap from noise. This script trains every kind of
slow_network.py (``--kinds``) from the same weights on the same batches for
each seed, on local processes (the arithmetic does not depend on the link),
and reads every kind's test accuracy at each checkpoint (``--at``, in
steps). It prints, per checkpoint, each kind's mean and spread over the
seeds and its gap to DDP paired by seed (kind minus DDP, mean, min, max).

    PYTHONPATH=py:build ~/.cache/bagua/venv-torch2/bin/python bench/powersgd_accuracy.py \\
        --model issue_mlp --rank 4 --start-iter 10 --seeds 0,1,2,3,4 --at 40,120 \\
        --out bench/results/powersgd_accuracy.json

Every rank must read the same accuracy for the synchronous kinds (one
model); the script fails where they differ.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

DEFAULT_KINDS = "ddp,powersgd,powersgd_8bit"


def train_seed(args, seed, rank, world):
    """{kind: {checkpoint: accuracy}} for one seed, every kind trained
    in turn step by step on this rank's batches."""
    import torch.nn.functional as F

    import slow_network

    slow_network.START_ITER = args.start_iter
    batches, test = slow_network.rank_batches(rank, world, args.batch, seed)
    runs = {kind: slow_network.make_run(kind, args.rank, args.lr, args.model, seed)
            for kind in args.kinds.split(",")}
    checkpoints = sorted(int(a) for a in args.at.split(","))
    found = {kind: {} for kind in runs}
    for step in range(1, checkpoints[-1] + 1):
        x, y = batches[(step - 1) % len(batches)]
        for kind, (model, opt) in runs.items():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if step in checkpoints:
                found[kind][step] = slow_network.accuracy(model, test)
    return found


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    report = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        found = train_seed(args, seed, rank, world)
        flat = torch.tensor([a for per in found.values() for a in per.values()], dtype=torch.float64)
        low, high = flat.clone(), flat.clone()
        bagua.allreduce_inplace(low, op=bagua.ReduceOp.MIN)
        bagua.allreduce_inplace(high, op=bagua.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise SystemExit(f"seed {seed}: the ranks' accuracies differ ({low.tolist()} against "
                             f"{high.tolist()}): a synchronous kind's replicas diverged")
        report[str(seed)] = found
        if rank == 0:
            print(f"seed {seed}: " + "; ".join(
                f"{kind} " + ", ".join(f"{a:.2f}" for a in per.values()) for kind, per in found.items()),
                flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report))


def summarize(per_seed, baseline="ddp"):
    """{checkpoint: {kind: {mean, sd, min, max, gap_mean, gap_min,
    gap_max}}}: the kind's accuracy over the seeds, and its gap to the
    baseline's accuracy of the same seed."""
    seeds = list(per_seed)
    kinds = list(per_seed[seeds[0]])
    checkpoints = list(per_seed[seeds[0]][kinds[0]])
    summary = {}
    for at in checkpoints:
        row = {}
        for kind in kinds:
            values = [per_seed[s][kind][at] for s in seeds]
            cell = {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "min": min(values), "max": max(values)}
            if baseline in kinds and kind != baseline:
                gaps = [per_seed[s][kind][at] - per_seed[s][baseline][at] for s in seeds]
                cell.update(gap_mean=statistics.mean(gaps), gap_min=min(gaps), gap_max=max(gaps))
            row[kind] = cell
        summary[at] = row
    return summary


def print_summary(summary, seeds):
    for at, row in summary.items():
        print(f"after {at} steps, {seeds} seeds:")
        print(f"{'kind':>24} {'mean %':>8} {'sd':>6} {'min':>7} {'max':>7} | {'gap to DDP: mean':>17} {'min':>7}"
              f" {'max':>7}")
        for kind, c in row.items():
            gap = (f"{c['gap_mean']:17.2f} {c['gap_min']:7.2f} {c['gap_max']:7.2f}" if "gap_mean" in c
                   else f"{'':>17} {'':>7} {'':>7}")
            print(f"{kind:>24} {c['mean']:8.2f} {c['sd']:6.2f} {c['min']:7.2f} {c['max']:7.2f} | {gap}")


def main():
    import slow_network
    from common import launch, machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="issue_mlp", choices=sorted(slow_network.MODELS))
    parser.add_argument("--kinds", default=DEFAULT_KINDS, help="slow_network.py's kinds; 'ddp' is the baseline")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    parser.add_argument("--start-iter", type=int, default=10, help="PowerSGD's uncompressed first steps")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="weights' and batch order's seeds")
    parser.add_argument("--at", default="40", help="checkpoints, in steps (the last is the run's length)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "powersgd_accuracy.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    unknown = set(args.kinds.split(",")) - set(slow_network.KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {slow_network.KINDS}")
    if any(not a.isdigit() or int(a) < 1 for a in args.at.split(",")):
        parser.error("--at: step counts of at least 1")
    worker_args = ["--model", args.model, "--kinds", args.kinds, "--rank", str(args.rank), "--start-iter",
                   str(args.start_iter), "--seeds", args.seeds, "--at", args.at, "--batch", str(args.batch),
                   "--lr", str(args.lr)]
    with tempfile.TemporaryDirectory() as tmp:
        per_seed = launch(__file__, args.world_size, Path(tmp) / "out.json", worker_args)
    summary = summarize(per_seed)
    print_summary(summary, len(per_seed))
    report = {"machine": machine(), "config": vars(args), "per_seed": per_seed, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
