"""What broadcasting BatchNorm buffers costs per step, for bagua and DDP.

A convolutional model with BatchNorm after every convolution (8 BatchNorm
layers, 3,000 buffer elements, 0.6 M parameters) trained on 2 ranks with
GradientAllReduce and with PyTorch DDP, each with ``broadcast_buffers``
True (rank 0's buffers before every training forward, the default) and
False, interleaved step by step with a barrier before each step (a step's
time is the slowest rank's).

    /usr/bin/python3 bench/buffers.py          # Debian's PyTorch
    python bench/buffers.py --world-size 3     # any PyTorch

Prints each kind's median and p90 step time and the cost of the broadcast
(True over False, per-step ratios: median and p10-p90); writes
bench/results/buffers.json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_steps, launch, machine, quantiles  # noqa: E402

KINDS = ["ddp/True", "ddp/False", "bagua/True", "bagua/False"]


def build_model():
    import torch

    layers, channels = [], 3
    for width in (32, 32, 64, 64, 96, 96, 128, 128):
        layers += [torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
        channels = width
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(channels, 10))


def make_run(kind):
    import torch

    from bagua.torch_api.algorithms import Algorithm

    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    system, broadcast = kind.split("/")
    if system == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast == "True"), opt
    return model.with_bagua([opt], Algorithm.init("gradient_allreduce"), broadcast_buffers=broadcast == "True"), opt


def cost(samples, system):
    ratios = sorted(a / b for a, b in zip(samples[f"{system}/True"]["total"], samples[f"{system}/False"]["total"]))
    pick = lambda q: ratios[min(len(ratios) - 1, int(round(q * (len(ratios) - 1))))]  # noqa: E731
    return {"median": statistics.median(ratios), "p10": pick(0.1), "p90": pick(0.9)}


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    g = torch.Generator().manual_seed(bagua.get_rank())
    batches = [(torch.randn(args.batch, 3, 16, 16, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(8)]
    runs = {kind: make_run(kind) for kind in KINDS}
    interleaved_steps(runs, batches, args.warmup)
    samples = interleaved_steps(runs, batches, args.steps)
    if bagua.get_rank() == 0:
        result = {"stages": {k: {s: quantiles(v) for s, v in st.items()} for k, st in samples.items()},
                  "cost": {system: cost(samples, system) for system in ("ddp", "bagua")}}
        Path(args.out).write_text(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "buffers.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        result = launch(__file__, args.world_size, Path(tmp) / "out.json",
                        ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)])
    report = {"machine": machine(), "torch": torch.__version__, "world": args.world_size, **result}
    print(f"torch {torch.__version__}, world {args.world_size}")
    print(f"{'kind':>12} {'median ms':>9} {'p90 ms':>8}")
    for kind, stages in result["stages"].items():
        print(f"{kind:>12} {stages['total']['median'] * 1e3:9.2f} {stages['total']['p90'] * 1e3:8.2f}")
    for system, c in result["cost"].items():
        print(f"{system}: broadcast_buffers True over False: {c['median']:.3f} (p10-p90 {c['p10']:.3f}-{c['p90']:.3f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
