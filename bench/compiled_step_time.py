"""Training step time under torch.compile: bagua's GradientAllReduce
against PyTorch DDP, both compiled (Gloo, CPU).

Each worker builds, per model, three runs from the same initial weights:
``torch.compile(DistributedDataParallel(model))``,
``torch.compile(model.with_bagua([opt], GradientAllReduceAlgorithm()))`` and
``torch.compile(model)`` alone with no communication (the floor). They are
timed interleaved step by step with a barrier before each step (a step's
time is the slowest rank's), after warmup steps that include compilation.
Both data-parallel runs have their forward cut into bucket-sized graphs by
Dynamo (DDP's own mechanism), so their backward overlaps communication.

    python bench/compiled_step_time.py                  # world 2, every model, inductor
    python bench/compiled_step_time.py --models wide_mlp --backend aot_eager

Needs PyTorch 2 (run it with the venv of scripts/torch2_venv.sh and
PYTHONPATH from scripts/env.sh). Prints per model each kind's median and p90
step time and the ratio bagua / DDP: the median of the per-step ratios
(steps paired by the interleaving) with their p10-p90 spread; writes
bench/results/compiled_step_time.json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_steps, launch, machine, quantiles  # noqa: E402

MODELS = ["wide_mlp", "deep_mlp", "transformer"]
KINDS = ["ddp", "gradient_allreduce", "local"]


def build_model(name):
    import torch

    if name == "wide_mlp":  # a few large tensors: 2.1 M parameters in 8
        widths = [512, 1024, 1024, 1024]
    elif name == "deep_mlp":  # many small tensors: 24 layers of 128
        widths = [128] * 25
    else:
        return SmallTransformer()
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 10))


def SmallTransformer():  # noqa: N802 - a factory named as the model it builds
    """Two encoder layers, width 256, 4 heads, sequences of 32: 1.6 M parameters."""
    import torch

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, batch_first=True,
                                                     dropout=0.0)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(256, 10)

        def forward(self, x):
            return self.head(self.encoder(x).mean(dim=1))

    return Classifier()


def batches_for(name, rank, batch):
    import torch

    g = torch.Generator().manual_seed(rank)
    shape = {"wide_mlp": (batch, 512), "deep_mlp": (batch, 128), "transformer": (batch // 2, 32, 256)}[name]
    return [(torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g))
            for _ in range(8)]


def make_run(kind, name, backend):
    import torch

    from bagua.torch_api.algorithms import Algorithm

    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "gradient_allreduce":
        model = model.with_bagua([opt], Algorithm.init("gradient_allreduce"))
    return torch.compile(model, backend=backend), opt


def paired_ratios(samples, kind):
    """Per-step ratios kind / DDP: median, p10 and p90."""
    ratios = sorted(a / b for a, b in zip(samples[kind]["total"], samples["ddp"]["total"]))
    pick = lambda q: ratios[min(len(ratios) - 1, int(round(q * (len(ratios) - 1))))]  # noqa: E731
    return {"median": statistics.median(ratios), "p10": pick(0.1), "p90": pick(0.9)}


def worker(args):
    import torch
    import torch._dynamo

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64  # three runs per model share forward code
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for name in args.models.split(","):
        torch._dynamo.reset()
        batches = batches_for(name, rank, args.batch)
        runs = {kind: make_run(kind, name, args.backend) for kind in KINDS}
        interleaved_steps(runs, batches, args.warmup)  # compilation, bagua's profiling step
        samples = interleaved_steps(runs, batches, args.steps)
        results[name] = {"stages": {kind: {stage: quantiles(v) for stage, v in stages.items()}
                                    for kind, stages in samples.items()},
                         "ratio": {kind: paired_ratios(samples, kind) for kind in KINDS if kind != "ddp"}}
        del runs
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def print_table(report):
    print(f"torch {report['torch']}, backend {report['config']['backend']}, world {report['config']['world']}")
    print(f"{'model':12} {'kind':>20} {'median ms':>9} {'p90 ms':>8} {'x DDP':>6} {'p10-p90':>13}")
    for name, r in report["results"].items():
        for kind, stages in r["stages"].items():
            ratio = r["ratio"].get(kind)
            spread = f"{ratio['p10']:6.3f}-{ratio['p90']:.3f}" if ratio else ""
            print(f"{name:12} {kind:>20} {stages['total']['median'] * 1e3:9.2f} "
                  f"{stages['total']['p90'] * 1e3:8.2f} {ratio['median'] if ratio else 1.0:6.3f} {spread:>13}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=80, help="timed steps per kind")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compiled_step_time.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {MODELS}")

    import tempfile

    import torch

    worker_args = ["--models", args.models, "--backend", args.backend, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch", str(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        results = launch(__file__, args.world_size, Path(tmp) / "out.json", worker_args)
    report = {"machine": machine(), "torch": torch.__version__,
              "config": {"world": args.world_size, "backend": args.backend, "steps": args.steps,
                         "batch_per_rank": args.batch}, "results": results}
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
