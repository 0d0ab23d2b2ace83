"""Train an MLP on scikit-learn's digits with bagua, on CPU workers.

    python -m bagua.distributed.launch --nproc_per_node 4 examples/digits_mlp.py

Each rank trains on its own shard of the training set; the algorithm keeps
the ranks' models in agreement. Rank 0 shows a progress bar and prints the
test accuracy at the end (and writes it as JSON with --results).
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import (async_model_average, auto, bytegrad, decentralized,
                                        gradient_allreduce, partial_allreduce, powersgd, q_adam)


def sgd(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


# name -> (optimizer factory, algorithm factory)
ALGORITHMS = {
    "gradient_allreduce": (sgd, lambda opt, args: gradient_allreduce.GradientAllReduceAlgorithm()),
    "gradient_allreduce_hierarchical": (
        sgd, lambda opt, args: gradient_allreduce.GradientAllReduceAlgorithm(hierarchical=True)),
    "bytegrad": (sgd, lambda opt, args: bytegrad.ByteGradAlgorithm()),
    "qadam": (lambda model, args: q_adam.QAdamOptimizer(model.parameters(), lr=args.adam_lr,
                                                         warmup_steps=args.warmup_steps),
              lambda opt, args: q_adam.QAdamAlgorithm(opt, hierarchical=not args.flat)),
    "low_precision_decentralized": (
        sgd, lambda opt, args: decentralized.LowPrecisionDecentralizedAlgorithm()),
    "decentralized": (sgd, lambda opt, args: decentralized.DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="all")),
    "decentralized_shift_one": (sgd, lambda opt, args: decentralized.DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="shift_one")),
    "decentralized_ring": (sgd, lambda opt, args: decentralized.DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="ring")),
    "async_model_average": (sgd, lambda opt, args: async_model_average.AsyncModelAverageAlgorithm(
        sync_interval_ms=args.sync_interval_ms, warmup_steps=args.warmup_steps,
        max_staleness_steps=args.max_staleness_steps)),
    # the ring among all ranks, no intra-node averaging first
    "low_precision_decentralized_ring": (
        sgd, lambda opt, args: decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)),
    # over a BlueFog graph of the ranks (--topology), full and low precision
    "decentralized_topology": (sgd, lambda opt, args: decentralized.DecentralizedAlgorithm(
        hierarchical=False, topology=topology(args))),
    "low_precision_decentralized_topology": (
        sgd, lambda opt, args: decentralized.LowPrecisionDecentralizedAlgorithm(
            hierarchical=False, topology=topology(args))),
    # low-rank gradients (rank 2) after 100 plain steps, error feedback
    "powersgd": (sgd, lambda opt, args: powersgd.PowerSGDAlgorithm(rank=2, start_iter=args.warmup_steps)),
    # measures the first 3 steps, then runs the algorithm predicted fastest here
    "auto": (sgd, lambda opt, args: auto.AutoAlgorithm(powersgd_rank=2, powersgd_start_iter=args.warmup_steps)),
    # Ripples: P-Reduce in groups of up to 3 chosen by each generator
    **{f"partial_allreduce_{generator}": (
        sgd, lambda opt, args, generator=generator: partial_allreduce.PartialAllReduceAlgorithm(
            group_size=3, group_generator=generator))
       for generator in ("smart", "random", "static")},
    # the same with MinMaxUInt8 on the wire inside each group
    "partial_allreduce_smart_low_precision": (
        sgd, lambda opt, args: partial_allreduce.PartialAllReduceAlgorithm(
            group_size=3, group_generator="smart", low_precision=True)),
}


TOPOLOGIES = ("exponential", "ring", "star", "mesh")


def topology(args):
    """The --topology graph over the world's ranks (bagua.bluefog.topology_util)."""
    from bagua.bluefog import topology_util

    n = bagua.get_world_size()
    return {"exponential": topology_util.ExponentialGraph, "ring": topology_util.RingGraph,
            "star": topology_util.StarGraph, "mesh": topology_util.MeshGrid2DGraph}[args.topology](n)


class MLP(torch.nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def load_data(seed):
    """The digits split into train and test (a quarter, stratified), cached
    under ~/.cache/bagua-examples: scikit-learn, which makes the split, takes
    longer to import than a short run takes to train."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bagua-examples"
    path = cache / f"digits_split_seed{seed}.npz"
    if not path.exists():
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = digits.data.astype(np.float32) / 16.0
        split = train_test_split(x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f".{path.name}.{os.getpid()}.npz"  # each rank writes its own, then renames
        np.savez(partial, x_train=split[0], x_test=split[1], y_train=split[2], y_test=split[3])
        os.replace(partial, path)
    with np.load(path) as data:
        return (torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"]).long(),
                torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"]).long())


def evaluate_on_every_rank(model, x_test, y_test, rank, world):
    """The test accuracy of every rank's model (to show whether they agree)."""
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    model.train()
    accuracies = torch.zeros(world)  # on the CPU: every backend can reduce it
    accuracies[rank] = accuracy
    bagua.allreduce_inplace(accuracies)
    return accuracies


DRIFT_FIGURES = [("steps_per_round", "mean"), ("steps_per_round", "max"), ("round_ms", "mean"),
                 ("round_ms", "max"), ("drift", None), ("relative_drift", None),
                 ("staleness_waits", None), ("staleness_wait_ms", None), ("rounds", None)]


def gather_drift(stats, rank, world):
    """Every rank's drift figures (async model average's stats()), for the
    results file: {figure: [per rank]}. Collective."""
    table = torch.zeros(world, len(DRIFT_FIGURES), dtype=torch.float64)
    for j, (key, sub) in enumerate(DRIFT_FIGURES):
        table[rank, j] = stats[key][sub] if sub else stats[key]
    bagua.allreduce_inplace(table)
    return {f"{key}_{sub}" if sub else key: table[:, j].tolist() for j, (key, sub) in enumerate(DRIFT_FIGURES)}


GROUP_FIGURES = ("executed", "executed_solo", "executed_mean_group_size", "waited_s")


def gather_group_stats(stats, rank, world):
    """Every rank's P-Reduce figures (the algorithm's stats()): how many
    groups it averaged in, alone, their mean size. Collective."""
    table = torch.zeros(world, len(GROUP_FIGURES), dtype=torch.float64)
    for j, key in enumerate(GROUP_FIGURES):
        table[rank, j] = stats[key]
    bagua.allreduce_inplace(table)
    return {key: table[:, j].tolist() for j, key in enumerate(GROUP_FIGURES)}


def staleness(text):
    """--max-staleness-steps: an integer, or "none" for unbounded."""
    return None if text.lower() == "none" else int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--algorithm", default="gradient_allreduce", choices=sorted(ALGORITHMS))
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--adam-lr", type=float, default=0.002, help="QAdam learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100,
                        help="QAdam / async model average warmup steps")
    parser.add_argument("--flat", action="store_true",
                        help="QAdam: compress among all ranks, not among the node leaders")
    parser.add_argument("--sync-interval-ms", type=int, default=10,
                        help="async model average: milliseconds between averaging rounds")
    parser.add_argument("--max-staleness-steps", type=staleness,
                        default=async_model_average.DEFAULT_MAX_STALENESS_STEPS,
                        help="async model average: local steps allowed between two completed "
                             "averaging rounds ('none': unbounded)")
    parser.add_argument("--no-final-average", action="store_true",
                        help="async model average: end with abort(model) alone, each rank keeping "
                             "its own model, instead of abort(model, average=True)")
    parser.add_argument("--topology", default="exponential", choices=TOPOLOGIES,
                        help="the graph of the *_topology algorithms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", help="write the final metrics as JSON to this file (rank 0)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank (LOCAL_RANK); with BAGUA_BACKEND=nccl")
    args = parser.parse_args()

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(args.seed)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", bagua.get_local_rank() % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data(args.seed))
    shard = torch.arange(rank, len(x_train), world)  # each rank its own slice
    x_shard, y_shard = x_train[shard], y_train[shard]

    model = MLP().to(device)
    make_optimizer, make_algorithm = ALGORITHMS[args.algorithm]
    optimizer = make_optimizer(model, args)
    algorithm = make_algorithm(optimizer, args)
    model = model.with_bagua([optimizer], algorithm)

    generator = torch.Generator().manual_seed(args.seed + rank)  # batch order, on the CPU
    steps_per_epoch = len(x_shard) // args.batch_size
    start = time.perf_counter()
    progress = tqdm(total=args.epochs * steps_per_epoch, disable=rank != 0, desc=args.algorithm)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_shard), generator=generator).to(device)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_shard[batch]), y_shard[batch])
            loss.backward()
            optimizer.step()
            progress.update(1)
        progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.4f}")
    progress.close()
    own_accuracies = None
    drift = None
    groups = None
    if isinstance(algorithm, async_model_average.AsyncModelAverageAlgorithm):
        # Stop the background averaging on every rank, evaluate each rank's
        # own model, then (by default) average the weights once more so all
        # ranks hold one model (a second abort with average=True).
        drift = gather_drift(algorithm.stats(model), rank, world)
        algorithm.abort(model)
        own_accuracies = evaluate_on_every_rank(model, x_test, y_test, rank, world)
        if not args.no_final_average:
            algorithm.abort(model, average=True)
    elif hasattr(algorithm, "abort"):
        # P-Reduce: each rank stops after draining its groups; the same
        # record of each rank's own model, then one final average.
        algorithm.abort(model)
        own_accuracies = evaluate_on_every_rank(model, x_test, y_test, rank, world)
        groups = gather_group_stats(algorithm.stats(model), rank, world)
        with torch.no_grad():
            for param in model.parameters():
                bagua.allreduce_inplace(param.data, op=bagua.ReduceOp.AVG)
    elapsed = time.perf_counter() - start

    accuracies = evaluate_on_every_rank(model, x_test, y_test, rank, world)
    accuracy = accuracies[rank].item()
    if rank == 0:
        print(f"algorithm {args.algorithm}: test accuracy {accuracy * 100:.2f}% "
              f"(ranks: {', '.join(f'{a * 100:.2f}' for a in accuracies.tolist())}), "
              f"{world} workers, {elapsed:.1f} s")
        if own_accuracies is not None:
            print("each rank's own model before the final average: "
                  f"{', '.join(f'{a * 100:.2f}' for a in own_accuracies.tolist())}")
        if args.results:
            with open(args.results, "w") as f:
                json.dump({"algorithm": args.algorithm, "world_size": world, "epochs": args.epochs,
                           "test_accuracy": accuracy, "rank_accuracies": accuracies.tolist(),
                           "own_model_accuracies": None if own_accuracies is None else own_accuracies.tolist(),
                           "train_seconds": elapsed, "async_stats": drift, "group_stats": groups}, f, indent=2)


if __name__ == "__main__":
    main()
