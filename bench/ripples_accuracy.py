"""Time to accuracy under a straggler: how long until the models of a
P-Reduce run reach a test accuracy on digits, against GradientAllReduce, in
the same processes.

Every rank trains the digits example's MLP (SGD, lr 0.05, momentum 0.9,
batch 16 per rank) on its shard for --seconds, with --compute-ms of emulated
compute per step (a sleep between forward and backward), the last rank s
times as long (--slowdown). GradientAllReduce's ranks take the steps the
straggler takes in that time (they must agree on a count). The algorithms
run --repeats rounds, interleaved (each round runs every algorithm once).

After every step each rank evaluates its own model on the test set; every
--snapshot-s it also keeps a copy of its weights. Three times are reported
per algorithm (the median round, with the rounds' range), each the first
moment the target is reached:

- ``rank 0``: rank 0's own model (a fast rank);
- ``every rank``: the last of the ranks' own models, the straggler's included;
- ``average``: the average of the ranks' latest copies (what a final
  average would deploy), evaluated at every snapshot time.

    /usr/bin/python3 bench/ripples_accuracy.py [--slowdown 3 --world-size 4 --local-size 0]

Writes bench/results/ripples_accuracy.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402
from ripples import _digits, _make  # noqa: E402


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _train(name, args, rank, world):
    """One round of ``name``: this rank's (seconds, accuracy) after every
    step and its weight copies (seconds, flat weights)."""
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua

    x_train, y_train, x_test, y_test = _digits(rank, world)
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algorithm = _make(name, world)
    model = model.with_bagua([opt], algorithm)
    g = torch.Generator().manual_seed(rank)
    sleep_s = args.compute_ms / 1000 * (args.slowdown if rank == world - 1 else 1)
    fixed_steps = None
    if name == "gradient_allreduce":
        fixed_steps = max(2, int(args.seconds / (args.compute_ms / 1000 * args.slowdown)))
    curve, snapshots = [], []
    bagua.barrier()
    start = time.perf_counter()
    steps, next_snapshot = 0, 0.0
    while (steps < fixed_steps) if fixed_steps else (time.perf_counter() - start < args.seconds):
        batch = torch.randint(0, len(x_train), (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        time.sleep(sleep_s)
        loss.backward()
        opt.step()
        steps += 1
        now = time.perf_counter() - start
        with torch.no_grad():
            curve.append((now, (model(x_test).argmax(dim=1) == y_test).float().mean().item()))
            if now >= next_snapshot:
                snapshots.append((now, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()))
                next_snapshot += args.snapshot_s
    if hasattr(algorithm, "abort"):
        algorithm.abort(model)
    model.without_bagua()
    bagua.barrier()
    return curve, snapshots


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    out = Path(args.out)
    for repeat in range(args.repeats):
        for name in args.algorithms:
            curve, snapshots = _train(name, args, rank, world)
            torch.save({"curve": curve, "snapshots": snapshots}, out.with_name(f"{name}.{repeat}.rank{rank}.pt"))
            if rank == 0:
                print(f"  round {repeat + 1}/{args.repeats} {name}: done", flush=True)
    bagua.barrier()
    if rank == 0:  # what launch() reads; the rounds are in the files beside it
        out.write_text(json.dumps({"rounds": args.repeats}))


def _first_reach(points, target):
    return next((t for t, a in points if a >= target), None)


def _average_curve(per_rank_snapshots, x_test, y_test):
    """Accuracy of the average of every rank's latest copy, at every
    snapshot time of any rank."""
    import torch

    model = _mlp()
    times = sorted({t for snaps in per_rank_snapshots for t, _ in snaps})
    curve = []
    for t in times:
        latest = [next((w for s, w in reversed(snaps) if s <= t), None) for snaps in per_rank_snapshots]
        if any(w is None for w in latest):
            continue
        torch.nn.utils.vector_to_parameters(sum(latest) / len(latest), model.parameters())
        with torch.no_grad():
            curve.append((t, (model(x_test).argmax(dim=1) == y_test).float().mean().item()))
    return curve


def measure(tmp, args):
    """Per algorithm and round: the three times to the target."""
    import torch

    _, _, x_test, y_test = _digits(0, 1)
    results = {}
    for name in args.algorithms:
        rounds = []
        for repeat in range(args.repeats):
            runs = [torch.load(Path(tmp) / f"{name}.{repeat}.rank{r}.pt") for r in range(args.world_size)]
            reach = [_first_reach(run["curve"], args.accuracy_target) for run in runs]
            average = _average_curve([run["snapshots"] for run in runs], x_test, y_test)
            rounds.append({"rank0": reach[0], "every_rank": None if None in reach else max(reach),
                           "average": _first_reach(average, args.accuracy_target),
                           "final_accuracy": [run["curve"][-1][1] for run in runs],
                           "final_average_accuracy": average[-1][1] if average else None})
        results[name] = {"rounds": rounds}
    return results


def summarize(results):
    base = results.get("gradient_allreduce")
    for name, entry in results.items():
        for key in ("rank0", "every_rank", "average"):
            times = [r[key] for r in entry["rounds"]]
            median = statistics.median(times) if None not in times else None
            entry[key] = {"seconds": median, "per_round": times}
        for key in ("rank0", "every_rank", "average"):
            b = base[key]["seconds"] if base else None
            s = entry[key]["seconds"]
            entry[key]["vs_gradient_allreduce"] = s / b if s is not None and b else None
    return results


def report(results, args):
    print(f"{args.world_size} ranks{f' ({args.local_size} per node)' if args.local_size else ''}, rank "
          f"{args.world_size - 1} {args.slowdown:g} times slower, {args.compute_ms:g} ms compute: seconds until "
          f"{args.accuracy_target:.2f} test accuracy on digits, median of {args.repeats} rounds (x GradientAllReduce)")
    print(f"{'algorithm':>20} {'rank 0':>16} {'every rank':>16} {'average':>16}   final accuracy per rank")
    for name, entry in results.items():
        cells = []
        for key in ("rank0", "every_rank", "average"):
            s, ratio = entry[key]["seconds"], entry[key]["vs_gradient_allreduce"]
            cells.append("not reached" if s is None else f"{s:6.2f} (x{ratio:.2f})" if ratio else f"{s:6.2f}")
        finals = entry["rounds"][len(entry["rounds"]) // 2]["final_accuracy"]
        print(f"{name:>20} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}   "
              + " ".join(f"{a:.3f}" for a in finals))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=0, help="ranks per simulated node (default: all)")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--algorithms", type=lambda t: t.split(","), default=["gradient_allreduce", "smart"])
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy-target", type=float, default=0.95)
    parser.add_argument("--snapshot-s", type=float, default=0.2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ripples_accuracy.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        worker_args = ["--slowdown", str(args.slowdown), "--algorithms", ",".join(args.algorithms),
                       "--compute-ms", str(args.compute_ms), "--seconds", str(args.seconds),
                       "--repeats", str(args.repeats), "--snapshot-s", str(args.snapshot_s),
                       "--accuracy-target", str(args.accuracy_target)]
        launch(__file__, args.world_size, Path(tmp) / "done.json", worker_args, args.local_size)
        results = summarize(measure(tmp, args))
    report(results, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "results": results}, indent=1))
    print(f"wrote {args.out}")
    return None


if __name__ == "__main__":
    main()
