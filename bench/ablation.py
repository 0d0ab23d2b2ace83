"""The O/F/H ablation (Bagua paper, Table 5) on CPU: step time of
GradientAllReduce with all of overlap (O), fusion/flattening (F) and
hierarchical communication (H) on, and with each one switched off, for a
model of many small tensors and one of a few large ones.

4 processes as 2 simulated nodes of 2 (LOCAL_WORLD_SIZE=2), so hierarchical
mode has an intra-node and an inter-node level. All configurations run in the
same processes, interleaved step by step with a barrier before each step;
PyTorch DDP runs alongside as a reference. Each step's time is the slowest
rank's. The whole comparison is repeated `--repeats` times in fresh processes
and the spread of each ratio over the repeats is printed.

    /usr/bin/python3 bench/ablation.py [--steps 40 --repeats 3]

Prints a table, writes bench/results/ablation.json and docs/ablation.png.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_steps, launch, machine, quantiles  # noqa: E402

MODELS = {
    "many_small": dict(width=96, depth=40, input=96),   # 82 tensors of a few KB
    "few_large": dict(width=1024, depth=3, input=1024),  # 8 tensors, up to 4 MB
}
BASELINE = "all on (O+F+H)"
CONFIGS = {
    "all on (O+F+H)": dict(overlap=True, do_flatten=True, hierarchical=True),
    "overlap off": dict(overlap=False, do_flatten=True, hierarchical=True),
    "flatten off": dict(overlap=True, do_flatten=False, hierarchical=True),
    "hierarchical off": dict(overlap=True, do_flatten=True, hierarchical=False),
}


def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for model_name, spec in MODELS.items():
        def build():
            torch.manual_seed(0)
            layers = [torch.nn.Linear(spec["input"], spec["width"]), torch.nn.ReLU()]
            for _ in range(spec["depth"] - 1):
                layers += [torch.nn.Linear(spec["width"], spec["width"]), torch.nn.ReLU()]
            return torch.nn.Sequential(*layers, torch.nn.Linear(spec["width"], 10))

        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(32, spec["input"], generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(4)]
        runs = {}
        for name, config in CONFIGS.items():
            model = build()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            model = model.with_bagua([opt], GradientAllReduceAlgorithm(hierarchical=config["hierarchical"]),
                                     do_flatten=config["do_flatten"], overlap=config["overlap"])
            runs[name] = (model, opt)
        model = build()
        runs["PyTorch DDP"] = (torch.nn.parallel.DistributedDataParallel(model),
                               torch.optim.SGD(model.parameters(), lr=0.01))

        interleaved_steps(runs, data, 3)  # warmup, with bagua's profiling iteration
        samples = interleaved_steps(runs, data, args.steps)
        results[model_name] = {name: quantiles(stages["total"]) for name, stages in samples.items()}
        del runs

    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def summarize(repeats):
    """Per-repeat medians -> {model: {configuration: {median ms, p90 ms,
    ratio to all on (median over repeats), its range}}}."""
    table = {}
    for model, configs in repeats[0].items():
        table[model] = {}
        for name in configs:
            ratios = [rep[model][name]["median"] / rep[model][BASELINE]["median"] for rep in repeats]
            table[model][name] = {
                "median_ms": statistics.median(rep[model][name]["median"] * 1e3 for rep in repeats),
                "p90_ms": statistics.median(rep[model][name]["p90"] * 1e3 for rep in repeats),
                "vs_all_on": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    return table


def plot(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(11, 3.8))
    for ax, (model, rows) in zip(axes, table.items()):
        names = list(rows)
        values = [rows[n]["median_ms"] for n in names]
        colors = ["#2b6cb0" if n == BASELINE else "#999999" if "DDP" in n else "#e07b39" for n in names]
        ax.barh(names[::-1], values[::-1], color=colors[::-1])
        ax.set_title(model.replace("_", " "))
        ax.set_xlabel("step time, ms (lower is better)")
        for y, v in enumerate(values[::-1]):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    fig.suptitle("GradientAllReduce ablation: 4 CPU processes, 2 simulated nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    parser.add_argument("--repeats", type=int, default=3, help="whole comparisons, fresh processes each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ablation.json"))
    parser.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" / "ablation.png"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    from tqdm import tqdm

    repeats = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in tqdm(range(args.repeats), desc="repeats"):
            repeats.append(launch(__file__, 4, Path(tmp) / "ablation.json", ["--steps", str(args.steps)],
                                  local_size=2))
    table = summarize(repeats)
    print(f"{'model':12} {'configuration':>20} {'median ms':>9} {'p90 ms':>8} {'vs all on':>10} {'range':>13}")
    for model, rows in table.items():
        for name, r in rows.items():
            print(f"{model:12} {name:>20} {r['median_ms']:9.2f} {r['p90_ms']:8.2f} {r['vs_all_on']:10.3f} "
                  f"{r['range'][0]:6.3f}-{r['range'][1]:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": {"steps": args.steps},
                                          "repeats": repeats, "table": table}, indent=2))
    plot(table, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
