"""Step time and accuracy on a bandwidth-limited network: bagua's algorithms
and algorithm="auto" against PyTorch DDP and DDP's fp16 and PowerSGD
communication hooks.

Each rank runs in its own network namespace, joined by a bridge, its egress
shaped with tbf to the given rate (bench/netns.py; needs root). At each rate
every kind trains the same MLP (64-2048-2048-10: 4.35 M parameters, 17.4 MB
of fp32 gradients) on digits from the same initial weights for the same
fixed number of steps, all kinds in the same processes, interleaved step by
step with a barrier before each step; a step's time is the slowest rank's.
The step time reported is the median (and p90) of the steps after
--skip-steps (PowerSGD's and the hook's uncompressed start, auto's measuring
steps); the accuracy is the test accuracy after the last step. DDP's
PowerSGD hook and our PowerSGD both run with one bucket (the hook needs it on
Gloo, see make_run; ours with one_bucket=True, as auto runs it); DDP and
its fp16 hook keep DDP's default buckets, ours the runtime's.

    /usr/bin/python3 bench/slow_network.py                       # 2 ranks, 100, 1000, 10000 Mbit/s
    /usr/bin/python3 bench/slow_network.py --rates 100 --steps 30 --kinds ddp,powersgd,auto
    /usr/bin/python3 bench/slow_network.py --plot-only bench/results/slow_network.json

Prints a table per rate (median, p90, ratio to DDP, accuracy, auto's
choice), writes bench/results/slow_network.json and the plot
docs/slow_network.png (step time against bandwidth).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import interleaved_steps, machine, quantiles  # noqa: E402

KINDS = ["ddp", "ddp_fp16_hook", "ddp_powersgd_hook", "gradient_allreduce", "bytegrad", "powersgd",
         "powersgd_8bit", "auto"]
WIDTH, INPUT, CLASSES = 2048, 64, 10
START_ITER = 10  # PowerSGD's and the hook's uncompressed first steps


def build_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(INPUT, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, CLASSES))


def make_run(kind, rank_r, lr):
    """(model, optimizer) for one kind; every kind starts from the same weights."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if kind.startswith("ddp"):
        if kind == "ddp_powersgd_hook":
            # One DDP bucket for the hook: with several, its chained
            # allreduces (P, then Q from a callback) of different buckets
            # are issued in a different order on different ranks, and Gloo
            # matches collectives by issue order: a size error or a hang
            # (seen here on torch 1.13 and 2.6 with DDP's default buckets).
            import torch.distributed as dist

            dist._DEFAULT_FIRST_BUCKET_BYTES, default = 1 << 30, dist._DEFAULT_FIRST_BUCKET_BYTES
            model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
            dist._DEFAULT_FIRST_BUCKET_BYTES = default
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        if kind == "ddp_fp16_hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif kind == "ddp_powersgd_hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                                start_powerSGD_iter=START_ITER, use_error_feedback=True,
                                                warm_start=True)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return model, opt
    from bagua.torch_api.algorithms.auto import AutoAlgorithm
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

    algorithm = {"gradient_allreduce": lambda: GradientAllReduceAlgorithm(),
                 "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
                 "powersgd": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER, one_bucket=True),
                 "powersgd_8bit": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER, low_precision=True,
                                                            one_bucket=True),
                 "auto": lambda: AutoAlgorithm(powersgd_rank=rank_r, powersgd_start_iter=START_ITER)}[kind]()
    return model.with_bagua([opt], algorithm), opt


def rank_batches(rank, world, batch):
    """This rank's shard of the digits training set, in batches."""
    import torch
    from digits_mlp import load_data

    x_train, y_train, x_test, y_test = load_data(0)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))[rank::world]
    batches = [(x_train[order[i:i + batch]], y_train[order[i:i + batch]])
               for i in range(0, len(order) - batch + 1, batch)]
    return batches, (x_test, y_test)


def accuracy(model, test):
    import torch

    model.eval()
    with torch.no_grad():
        result = (model(test[0]).argmax(dim=1) == test[1]).float().mean().item()
    model.train()
    return 100.0 * result


def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.auto import AutoAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    batches, test = rank_batches(rank, world, args.batch)
    runs = {kind: make_run(kind, args.rank, args.lr) for kind in args.kinds.split(",")}
    samples = interleaved_steps(runs, batches, args.steps)
    result = {}
    for kind, stages in samples.items():
        result[kind] = quantiles(stages["total"][args.skip_steps:])
        result[kind]["accuracy"] = accuracy(runs[kind][0], test)
        if kind == "auto":
            result[kind]["decision"] = AutoAlgorithm.decision(runs[kind][0])
    # every rank's accuracy must agree (the synchronous kinds train one model)
    mine = torch.tensor([result[k]["accuracy"] for k in runs], dtype=torch.float64)
    spread = mine.clone()
    bagua.allreduce_inplace(spread, op=bagua.ReduceOp.MAX)
    low = mine.clone()
    bagua.allreduce_inplace(low, op=bagua.ReduceOp.MIN)
    for kind, hi, lo in zip(runs, spread.tolist(), low.tolist()):
        result[kind]["accuracy_spread_over_ranks"] = hi - lo
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))


def print_table(rate, result):
    ddp = result["ddp"]["median"] if "ddp" in result else None
    print(f"{'kind':>20} {'median ms':>10} {'p90 ms':>9} {'x DDP':>7} {'accuracy':>9}")
    for kind, q in result.items():
        ratio = f"{q['median'] / ddp:7.3f}" if ddp else "    n/a"
        note = f"  (chose {q['decision']['choice']})" if kind == "auto" and q.get("decision") else ""
        print(f"{kind:>20} {q['median'] * 1e3:10.1f} {q['p90'] * 1e3:9.1f} {ratio} {q['accuracy']:8.2f}%{note}")


def plot(report, path: Path) -> None:
    """Median step time against bandwidth, one line per kind (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(report["rates"], key=int)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = list(report["rates"][rates[0]])
    for kind in kinds:
        xs = [int(r) for r in rates if kind in report["rates"][r]]
        ys = [report["rates"][r][kind]["median"] * 1e3 for r in rates if kind in report["rates"][r]]
        style = "--" if kind.startswith("ddp") else "-"
        ax.plot(xs, ys, style, marker="o", label=kind, linewidth=2.5 if kind == "auto" else 1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth per rank (Mbit/s, tbf)")
    ax.set_ylabel("median step time (ms)")
    cfg = report["config"]
    ax.set_title(f"{cfg['world_size']} ranks, MLP 64-2048-2048-10 (17.4 MB of gradients), digits")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000,10000", help="Mbit/s per rank's egress, comma-separated")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS), help="from: " + ", ".join(KINDS))
    parser.add_argument("--rank", type=int, default=2,
                        help="PowerSGD's matrix approximation rank (ours, the hook's, auto's); at rank 1, "
                             "60 steps left both 2.9-4 points of accuracy below DDP's")
    parser.add_argument("--steps", type=int, default=60, help="training steps of every kind")
    parser.add_argument("--skip-steps", type=int, default=20, help="steps left out of the step time")
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "slow_network.json"))
    parser.add_argument("--plot", default=str(Path(__file__).resolve().parents[1] / "docs" / "slow_network.png"))
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the plot from a saved report")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.plot_only:
        return plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot))
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    if args.skip_steps >= args.steps:
        parser.error("--skip-steps must be below --steps")

    from netns import emulated_hosts, launch_on_hosts

    worker_args = ["--kinds", args.kinds, "--rank", str(args.rank), "--steps", str(args.steps),
                   "--skip-steps", str(args.skip_steps), "--batch", str(args.batch), "--lr", str(args.lr)]
    report = {"machine": machine(), "config": vars(args), "rates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in [int(r) for r in args.rates.split(",")]:
            print(f"{rate} Mbit/s, {args.world_size} ranks, {args.steps} steps ...", flush=True)
            with emulated_hosts(args.world_size, rates_mbit={r: rate for r in range(args.world_size)}) as hosts:
                result = launch_on_hosts(__file__, hosts, Path(tmp) / f"{rate}.json", worker_args)
            report["rates"][str(rate)] = result
            print_table(rate, result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    plot(report, Path(args.plot))


if __name__ == "__main__":
    main()
