"""Ripples across nodes: does every rank's own model stay within 1.5 points
of GradientAllReduce's on digits, for each generator, world size and
number of ranks per node?

For each (world size, ranks per node) cell, one set of processes
(LOCAL_WORLD_SIZE = ranks per node, nodes being consecutive ranks) trains
the digits example's loop (examples/digits_mlp.py: its MLP, SGD lr 0.05 with
momentum 0.9, batch 16 per rank, each rank its shard, --epochs) with
GradientAllReduce and with PartialAllReduce's static, random and smart
generators (groups of up to 3), for each --seeds, algorithms interleaved.
A P-Reduce run ends as the example does: ``abort(model)``, then every rank
evaluates its own model (before any final average).

Reported per cell and generator: the gap, GradientAllReduce's accuracy
minus the worst rank's own accuracy, in points, for each seed.

    /usr/bin/python3 bench/ripples_nodes.py [--worlds 4,6,8 --locals 1,2,4 --seeds 0,1,2]

Writes bench/results/ripples_nodes.json (--out).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402
from ripples import _digits  # noqa: E402

ALGORITHMS = ("gradient_allreduce", "static", "random", "smart")


def _train(name, seed, epochs, data, rank, world):
    """This rank's own test accuracy after the example's loop."""
    import torch
    import torch.nn.functional as F

    from bagua.torch_api.algorithms import gradient_allreduce
    from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm

    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "gradient_allreduce":
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    else:
        algorithm = PartialAllReduceAlgorithm(group_size=min(3, world), group_generator=name)
    model = model.with_bagua([opt], algorithm)
    generator = torch.Generator().manual_seed(seed + rank)
    steps_per_epoch = len(x_train) // 16
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * 16:(step + 1) * 16]
            opt.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            opt.step()
    if hasattr(algorithm, "abort"):
        algorithm.abort(model)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    model.without_bagua()
    return accuracy


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    for seed in args.seeds:
        data = _digits(rank, world, seed)
        for name in ALGORITHMS:
            accuracies = torch.zeros(world)
            accuracies[rank] = _train(name, seed, args.epochs, data, rank, world)
            bagua.allreduce_inplace(accuracies)
            results.setdefault(name, []).append(accuracies.tolist())
    bagua.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def _gaps(cell):
    """Per generator: GradientAllReduce's accuracy minus the worst rank's,
    in points, per seed."""
    reference = [max(accs) for accs in cell["gradient_allreduce"]]  # every rank holds the same model
    return {name: [round(100 * (ref - min(accs)), 2) for ref, accs in zip(reference, cell[name])]
            for name in ALGORITHMS[1:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", default="4,6,8")
    parser.add_argument("--locals", default="1,2,4", help="ranks per node")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ripples_nodes.json"))
    args = parser.parse_args()
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    if args.worker:
        worker(args)
        return

    report = {"machine": machine(), "epochs": args.epochs, "seeds": args.seeds, "cells": []}
    print("gap = GradientAllReduce's accuracy - the worst rank's own, points, per seed")
    print(f"{'world':>5} {'per node':>8} {'GA %':>14}  " + "  ".join(f"{n:>18}" for n in ALGORITHMS[1:]))
    for world in [int(w) for w in args.worlds.split(",")]:
        for local in [int(n) for n in args.locals.split(",")]:
            if local > world:
                continue
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                cell = launch(__file__, world, Path(tmp) / "cell.json",
                              ["--seeds", ",".join(map(str, args.seeds)), "--epochs", str(args.epochs)],
                              local_size=local)
            gaps = _gaps(cell)
            report["cells"].append({"world_size": world, "local_size": local, "accuracies": cell, "gaps": gaps,
                                    "seconds": time.perf_counter() - started})
            ga = "/".join(f"{100 * max(a):.1f}" for a in cell["gradient_allreduce"])
            print(f"{world:>5} {local:>8} {ga:>14}  "
                  + "  ".join(f"{'/'.join(f'{g:.1f}' for g in gaps[n]):>18}" for n in ALGORITHMS[1:]), flush=True)
    worst = {n: max(g for c in report["cells"] for g in c["gaps"][n]) for n in ALGORITHMS[1:]}
    mean = {n: statistics.mean(g for c in report["cells"] for g in c["gaps"][n]) for n in ALGORITHMS[1:]}
    report["worst_gap"], report["mean_gap"] = worst, mean
    print("worst gap: " + ", ".join(f"{n} {worst[n]:.2f}" for n in worst)
          + "; mean: " + ", ".join(f"{n} {mean[n]:.2f}" for n in mean))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
