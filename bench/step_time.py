"""Training step time: bagua's algorithms against PyTorch DDP (Gloo).

Same model, same data, same world size, same processes, in one run: each
worker times DDP and every bagua algorithm in alternating rounds (so drift in
machine load hits all of them) and the median step time of each is compared.

    /usr/bin/python3 bench/step_time.py                       # world sizes 2 and 4
    /usr/bin/python3 bench/step_time.py --world-sizes 2 --algorithms gradient_allreduce,bytegrad

Prints a table with the ratio DDP / algorithm (> 1: faster than DDP) and
writes bench/results/step_time.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine, median_slowest, timed_steps  # noqa: E402

MODELS = {
    # a few large tensors: 3 x 1024-wide layers, 2.2 M parameters
    "wide_mlp": dict(width=1024, depth=3, input=512),
    # many small tensors: 24 x 128-wide layers, 50 tensors
    "deep_mlp": dict(width=128, depth=24, input=128),
}


def build_model(spec):
    import torch

    layers = [torch.nn.Linear(spec["input"], spec["width"]), torch.nn.ReLU()]
    for _ in range(spec["depth"] - 1):
        layers += [torch.nn.Linear(spec["width"], spec["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(spec["width"], 10))
    return torch.nn.Sequential(*layers)


def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import bytegrad, decentralized, gradient_allreduce

    algorithms = {
        "gradient_allreduce": lambda: gradient_allreduce.GradientAllReduceAlgorithm(),
        "bytegrad": lambda: bytegrad.ByteGradAlgorithm(hierarchical=False),
        "low_precision_decentralized":
            lambda: decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
    }
    kinds = ["ddp"] + args.algorithms.split(",")

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for model_name, spec in MODELS.items():
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(args.batch, spec["input"], generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(8)]

        def make(kind):
            torch.manual_seed(0)
            model = build_model(spec)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            if kind == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            else:
                model = model.with_bagua([opt], algorithms[kind]())
            return model, opt

        def time_steps(model, opt, steps):
            return timed_steps(model, opt, batches, steps)

        runs = {kind: make(kind) for kind in kinds}
        for kind, (model, opt) in runs.items():
            time_steps(model, opt, args.warmup)  # includes bagua's profiling iteration
        samples = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind, (model, opt) in runs.items():
                bagua.barrier()
                samples[kind] += time_steps(model, opt, args.steps)
        # the slowest rank sets the pace: take each step's max over ranks
        summary = median_slowest(samples)
        params = sum(p.numel() for p in build_model(spec).parameters())
        tensors = len(list(build_model(spec).parameters()))
        results[model_name] = {"step_s": summary, "parameters": params, "tensors": tensors,
                               "ratio_ddp_over": {k: summary["ddp"] / v for k, v in summary.items()}}
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--algorithms", default="gradient_allreduce,bytegrad",
                        help="comma-separated: gradient_allreduce, bytegrad, low_precision_decentralized")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_time.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    from tqdm import tqdm

    sizes = [int(s) for s in args.world_sizes.split(",")]
    report = {"machine": machine(),
              "config": {"steps": args.steps, "rounds": args.rounds, "batch_per_rank": args.batch},
              "results": {}}
    worker_args = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   "--batch", str(args.batch), "--algorithms", args.algorithms]
    with tempfile.TemporaryDirectory() as tmp:
        for world in tqdm(sizes, desc="world sizes"):
            report["results"][str(world)] = launch(__file__, world, Path(tmp) / f"world{world}.json",
                                                   worker_args)
    print(f"\n{'model':10} {'world':>5} {'algorithm':>28} {'step ms':>9} {'DDP/this':>9}")
    for world, models in report["results"].items():
        for name, r in models.items():
            for kind, seconds in r["step_s"].items():
                print(f"{name:10} {world:>5} {kind:>28} {seconds * 1e3:9.2f} "
                      f"{r['ratio_ddp_over'][kind]:9.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
