"""Ripples under a straggler: throughput of P-Reduce (smart, random and static
group generation) against GradientAllReduce and AsyncModelAverage, in one run.

As in the Ripples paper, compute is emulated by sleeping, so CPU ranks do not
fight over cores: every rank sleeps --compute-ms per step (inside a real step
of a small MLP, between its forward and backward, where compute would be)
and the last rank s times as long, for each slowdown s of --slowdowns. Each (algorithm, s) runs in the same processes, one after the
other, for --seconds of wall time per rank (GradientAllReduce, whose ranks
must take equal step counts: the steps the straggler takes in that time).

Reported per (algorithm, s): aggregate samples/s over all ranks, the fast
ranks' median steps/s, the straggler's steps/s, the share of the
straggler's P-Reduces with company, and the ratios to GradientAllReduce at
the same s. The ideal of a straggler-immune algorithm is ((n-1)s+1)/n times
All-Reduce's aggregate throughput.

    /usr/bin/python3 bench/ripples.py [--world-size 4 --slowdowns 1,2,3,6]

Writes bench/results/ripples.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402

ALGORITHMS = ["gradient_allreduce", "smart", "random", "static", "async_model_average"]
# also accepted in --algorithms: smart_lp, random_lp, static_lp (low_precision=True)
BATCH = 32


def _make(name, world):
    from bagua.torch_api.algorithms import async_model_average, gradient_allreduce
    from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm

    if name == "gradient_allreduce":
        return gradient_allreduce.GradientAllReduceAlgorithm()
    if name == "async_model_average":
        return async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=50)
    if name == "smart_default":  # every argument at its default
        return PartialAllReduceAlgorithm(group_size=min(3, world))
    # "<generator>_lp": the same with MinMaxUInt8 on the wire inside the group
    generator, low_precision = name.removesuffix("_lp"), name.endswith("_lp")
    threshold = 5 if generator == "smart" else None
    return PartialAllReduceAlgorithm(group_size=min(3, world), group_generator=generator,
                                     slowdown_threshold=threshold, low_precision=low_precision)


def _run(name, args, rank, world, slowdown):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    algorithm = _make(name, world)
    model = model.with_bagua([opt], algorithm)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    sleep_s = args.compute_ms / 1000 * (slowdown if rank == world - 1 else 1)
    # GradientAllReduce's ranks must agree on a step count: the straggler's.
    fixed_steps = None
    if name == "gradient_allreduce":
        fixed_steps = max(2, int(args.seconds / (args.compute_ms / 1000 * slowdown)))
    bagua.barrier()
    start = time.perf_counter()
    steps = 0
    while (steps < fixed_steps) if fixed_steps else (time.perf_counter() - start < args.seconds):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        time.sleep(sleep_s)  # the emulated compute, between forward and backward
        loss.backward()
        opt.step()
        steps += 1
    seconds = time.perf_counter() - start
    company = None
    if hasattr(algorithm, "abort"):
        algorithm.abort(model)
    if hasattr(algorithm, "history"):
        history = algorithm.history(model)  # without the groups drained at abort
        history = history[:len(history) - algorithm.stats(model)["drained"]]
        company = sum(1 for h in history if len(h[2]) > 1) / max(1, len(history))
    model.without_bagua()
    row = torch.tensor([[steps, seconds, -1.0 if company is None else company]], dtype=torch.float64)
    rows = torch.zeros(world, 3, dtype=torch.float64)
    bagua.allgather(row.reshape(-1), rows.reshape(-1))
    bagua.barrier()
    return rows.tolist()


def _digits(rank, world, seed=0):
    """Digits split into train and test (a quarter, stratified, by ``seed``),
    and ``rank``'s shard of the training set."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=seed,
                                                        stratify=digits.target)
    shard = slice(rank, None, world)
    return (torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard]).long(),
            torch.from_numpy(x_test), torch.from_numpy(y_test).long())


def _run_to_accuracy(name, args, rank, world, slowdown):
    """Digits (the example's MLP, SGD with momentum) for --seconds per rank,
    the straggler s times slower; rank 0 (a fast rank) evaluates its own
    model after every step (about 0.3 ms): (seconds, test accuracy) pairs."""
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua

    x_train, y_train, x_test, y_test = _digits(rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algorithm = _make(name, world)
    model = model.with_bagua([opt], algorithm)
    g = torch.Generator().manual_seed(rank)
    sleep_s = args.compute_ms / 1000 * (slowdown if rank == world - 1 else 1)
    fixed_steps = None
    if name == "gradient_allreduce":
        fixed_steps = max(2, int(args.seconds / (args.compute_ms / 1000 * slowdown)))
    curve = []
    bagua.barrier()
    start = time.perf_counter()
    steps = 0
    while (steps < fixed_steps) if fixed_steps else (time.perf_counter() - start < args.seconds):
        batch = torch.randint(0, len(x_train), (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        time.sleep(sleep_s)
        loss.backward()
        opt.step()
        steps += 1
        if rank == 0:
            with torch.no_grad():
                accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
            curve.append((time.perf_counter() - start, accuracy))
    if hasattr(algorithm, "abort"):
        algorithm.abort(model)
    model.without_bagua()
    bagua.barrier()
    return curve


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    if args.accuracy_target:
        curves = {name: [] for name in args.algorithms}
        for repeat in range(args.repeats):  # interleaved: every algorithm once per round
            for name in args.algorithms:
                curves[name].append(_run_to_accuracy(name, args, rank, world, args.slowdowns[0]))
                if rank == 0:
                    print(f"  round {repeat + 1}/{args.repeats} {name}: done", flush=True)
        if rank == 0:
            Path(args.out).write_text(json.dumps(curves))
        return
    results = []
    for slowdown in args.slowdowns:
        for name in args.algorithms:
            per_rank = _run(name, args, rank, world, slowdown)
            results.append({"algorithm": name, "slowdown": slowdown, "per_rank": per_rank})
            if rank == 0:
                print(f"  s={slowdown} {name}: done", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def summarize(raw, world, batch=BATCH):
    rows = []
    for entry in raw:
        per_rank = entry["per_rank"]
        rates = [steps / seconds for steps, seconds, _ in per_rank]
        rows.append({"algorithm": entry["algorithm"], "slowdown": entry["slowdown"],
                     "samples_per_s": sum(rates) * batch,
                     "fast_steps_per_s": statistics.median(rates[:-1]) if world > 1 else rates[0],
                     "straggler_steps_per_s": rates[-1],
                     "straggler_company": per_rank[-1][2] if per_rank[-1][2] >= 0 else None})
    for row in rows:
        base = next(r for r in rows if r["algorithm"] == "gradient_allreduce" and r["slowdown"] == row["slowdown"])
        s1 = next((r for r in rows if r["algorithm"] == row["algorithm"] and r["slowdown"] == 1), None)
        row["throughput_vs_gradient_allreduce"] = row["samples_per_s"] / base["samples_per_s"]
        row["ideal_vs_gradient_allreduce"] = ((world - 1) * row["slowdown"] + 1) / world
        row["fast_rate_kept_vs_s1"] = row["fast_steps_per_s"] / s1["fast_steps_per_s"] if s1 else None
    return rows


def report_time_to_accuracy(curves, args):
    """Per algorithm, the median over the rounds of the seconds until rank 0
    first reached the target (a round that never did counts as missing)."""
    target = args.accuracy_target

    def first_reach(curve):
        return next((t for t, a in curve if a >= target), None)

    print(f"{args.world_size} ranks, rank {args.world_size - 1} {args.slowdowns[0]:g} times slower: "
          f"seconds until rank 0 reaches {target:.2f} test accuracy on digits, median of {args.repeats} "
          f"interleaved rounds (min-max)")
    reached = {name: [first_reach(c) for c in runs] for name, runs in curves.items()}
    medians = {name: statistics.median(times) if times and None not in times else None
               for name, times in reached.items()}
    base = medians.get("gradient_allreduce")
    rows = {}
    for name, times in reached.items():
        best = max((a for c in curves[name] for _, a in c), default=0.0)
        seconds = medians[name]
        ratio = seconds / base if seconds is not None and base else None
        rows[name] = {"seconds": seconds, "seconds_per_round": times, "best_accuracy": best,
                      "vs_gradient_allreduce": ratio}
        spread = "" if None in times else f"({min(times):.2f}-{max(times):.2f})"
        print(f"{name:>22} {'not reached' if seconds is None else f'{seconds:6.2f} s':>12} {spread:>13} "
              f"best {best:.4f} {'' if ratio is None else f'x GA {ratio:.2f}'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # The curves (one point per step and round) without indentation: a tenth of the size.
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "results": rows,
                                          "curves": curves}))
    print(f"wrote {args.out}")


def plot(rows, path, world):
    """Aggregate throughput over GradientAllReduce's against s, with the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    slowdowns = sorted({r["slowdown"] for r in rows})
    ax.plot(slowdowns, [((world - 1) * s + 1) / world for s in slowdowns], "k--", label="ideal")
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        mine = sorted((r["slowdown"], r["throughput_vs_gradient_allreduce"]) for r in rows if r["algorithm"] == name)
        ax.plot([s for s, _ in mine], [v for _, v in mine], "o-", label=name)
    ax.set_xlabel("slowdown s of one rank")
    ax.set_ylabel("aggregate throughput / GradientAllReduce's")
    ax.set_title(f"{world} ranks, one straggler (bench/ripples.py)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=0, help="ranks per simulated node (default: all)")
    parser.add_argument("--slowdowns", type=lambda t: [float(v) for v in t.split(",")], default=[1, 2, 3, 6])
    parser.add_argument("--algorithms", type=lambda t: t.split(","), default=ALGORITHMS)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per step")
    parser.add_argument("--seconds", type=float, default=4.0, help="wall time per (algorithm, s) and rank")
    parser.add_argument("--accuracy-target", type=float, default=0.0,
                        help="instead of throughput: seconds until rank 0's model reaches this test accuracy "
                             "on digits, at the first of --slowdowns")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --accuracy-target: interleaved rounds of every algorithm (the median is reported)")
    parser.add_argument("--slow-link-mbit", type=float, default=0.0,
                        help="ranks on emulated hosts (network namespaces, needs root); the last rank's "
                             "egress limited to this many Mbit/s instead of (or besides) slow compute")
    parser.add_argument("--plot", help="also draw the throughput ratios into this PNG")
    parser.add_argument("--from-json", help="summarize (and plot) a results file of an earlier run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ripples.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        if args.plot:
            plot(saved["results"], args.plot, saved["config"]["world_size"])
        return None

    import tempfile

    worker_args = ["--slowdowns", ",".join(str(s) for s in args.slowdowns), "--algorithms",
                   ",".join(args.algorithms), "--compute-ms", str(args.compute_ms), "--seconds", str(args.seconds),
                   "--accuracy-target", str(args.accuracy_target), "--repeats", str(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.slow_link_mbit:
            from netns import emulated_hosts, launch_on_hosts

            with emulated_hosts(args.world_size, {args.world_size - 1: args.slow_link_mbit}) as hosts:
                raw = launch_on_hosts(__file__, hosts, Path(tmp) / "ripples.json", worker_args)
        else:
            raw = launch(__file__, args.world_size, Path(tmp) / "ripples.json", worker_args, args.local_size)
    if args.accuracy_target:
        return report_time_to_accuracy(raw, args)
    rows = summarize(raw, args.world_size)
    print(f"{args.world_size} ranks, {args.compute_ms:.0f} ms emulated compute per step, "
          f"rank {args.world_size - 1} s times slower"
          + (f", its egress limited to {args.slow_link_mbit:g} Mbit/s" if args.slow_link_mbit else ""))
    print(f"{'s':>3} {'algorithm':>20} {'samples/s':>10} {'x GA':>6} {'ideal':>6} {'fast st/s':>10} "
          f"{'kept vs s=1':>11} {'slow st/s':>10} {'slow w/ company':>15}")
    for r in rows:
        kept = "" if r["fast_rate_kept_vs_s1"] is None else f"{r['fast_rate_kept_vs_s1']:.2f}"
        company = "" if r["straggler_company"] is None else f"{r['straggler_company']:.2f}"
        print(f"{r['slowdown']:3.0f} {r['algorithm']:>20} {r['samples_per_s']:10.0f} "
              f"{r['throughput_vs_gradient_allreduce']:6.2f} {r['ideal_vs_gradient_allreduce']:6.2f} "
              f"{r['fast_steps_per_s']:10.1f} {kept:>11} {r['straggler_steps_per_s']:10.1f} {company:>15}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "results": rows}, indent=2))
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot, args.world_size)


if __name__ == "__main__":
    main()
