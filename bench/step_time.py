"""Training step time: bagua's algorithms against PyTorch DDP (Gloo).

Same model, same data, same world size, same processes: each worker runs DDP
and every bagua algorithm interleaved step by step, with a barrier before
each step, so drift in machine load hits all of them alike. A step's time is
the maximum over ranks; each kind gets the median and p90 of those. The whole
comparison (fresh processes) is repeated `--repeats` times and the spread of
the ratio over the repeats is printed.

    /usr/bin/python3 bench/step_time.py                       # world sizes 2 and 4
    /usr/bin/python3 bench/step_time.py --world-sizes 2 --algorithms gradient_allreduce,bytegrad
    /usr/bin/python3 bench/step_time.py --busy 1              # one extra process spinning
    /usr/bin/python3 bench/step_time.py --algorithms gradient_allreduce,gradient_allreduce@tcp
    /usr/bin/python3 bench/step_time.py --algorithms gradient_allreduce,local   # with the floor

The kind "local" trains each rank's model alone, without any communication
(the gradients are not averaged): the floor no gradient exchange can go below.

An algorithm named with "@tcp" runs on a process group whose communicators
keep every collective on loopback TCP (BAGUA_SHARED_MEMORY=0 while the group
is made): the transport before shared memory, in the same run.

Prints, per model and world size, each kind's median and p90 step time, the
median time of each stage (forward, backward with the communication wait,
optimizer step), and the ratio algorithm / DDP (< 1: faster than DDP) with
its range over the repeats; writes bench/results/step_time.json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import BusyLoad, interleaved_steps, launch, machine, quantiles  # noqa: E402

MODELS = {
    # a few large tensors: 3 x 1024-wide layers, 8 tensors, 2.1 M parameters
    "wide_mlp": dict(width=1024, depth=3, input=512),
    # many small tensors: 24 x 128-wide layers, 50 tensors
    "deep_mlp": dict(width=128, depth=24, input=128),
}

ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", "GradientAllReduceAlgorithm", {}),
    "bytegrad": ("bytegrad", "ByteGradAlgorithm", {"hierarchical": False}),
    "decentralized": ("decentralized", "DecentralizedAlgorithm", {"hierarchical": False}),
    "low_precision_decentralized":
        ("decentralized", "LowPrecisionDecentralizedAlgorithm", {"hierarchical": False}),
}


def build_model(spec):
    import torch

    layers = [torch.nn.Linear(spec["input"], spec["width"]), torch.nn.ReLU()]
    for _ in range(spec["depth"] - 1):
        layers += [torch.nn.Linear(spec["width"], spec["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(spec["width"], 10))
    return torch.nn.Sequential(*layers)


def make_algorithm(kind):
    import importlib

    module, cls, kwargs = ALGORITHMS[kind.split("@")[0]]
    return getattr(importlib.import_module(f"bagua.torch_api.algorithms.{module}"), cls)(**kwargs)


def tcp_only_group():
    """A group of all ranks whose communicators never use shared memory."""
    import os

    import bagua.torch_api as bagua
    from bagua.torch_api._core import core

    os.environ["BAGUA_SHARED_MEMORY"] = "0"
    core._testing.reload_env()
    try:
        group = bagua.new_group(list(range(bagua.get_world_size())))
        group.get_bucket_communicator()  # made now, while the variable says so
    finally:
        del os.environ["BAGUA_SHARED_MEMORY"]
        core._testing.reload_env()
    return group


def make_run(kind, spec, tcp_group):
    import torch

    torch.manual_seed(0)
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "local":
        pass  # no communication at all: the floor
    else:
        group = tcp_group if kind.endswith("@tcp") else None
        model = model.with_bagua([opt], make_algorithm(kind), process_group=group)
    return model, opt


def summarize(samples):
    """{kind: {stage: [s]}} -> {kind: {stage: {median, p90}}}."""
    return {kind: {stage: quantiles(values) for stage, values in stages.items()}
            for kind, stages in samples.items()}


def worker(args):
    import torch

    import bagua.torch_api as bagua

    kinds = ["ddp"] + args.algorithms.split(",")
    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    tcp_group = tcp_only_group() if "@tcp" in args.algorithms else None
    results = {}
    for model_name, spec in MODELS.items():
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(args.batch, spec["input"], generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(8)]
        runs = {kind: make_run(kind, spec, tcp_group) for kind in kinds}
        interleaved_steps(runs, batches, args.warmup)  # includes bagua's profiling iteration
        stats = summarize(interleaved_steps(runs, batches, args.steps))
        params = build_model(spec).parameters()
        results[model_name] = {"stages": stats, "tensors": len(list(params))}
        del runs
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def ratios(repeats, world, model, kind):
    """This kind's median step time over DDP's, one per repeat."""
    out = []
    for rep in repeats:
        stages = rep[world][model]["stages"]
        out.append(stages[kind]["total"]["median"] / stages["ddp"]["total"]["median"])
    return out


def print_table(report):
    repeats = report["repeats"]
    blas = report["machine"]["blas"]
    print(f"\nBLAS: {blas['library']} ({blas.get('sgemm_gflops_1_thread', '?')} GFLOP/s on one "
          "thread for a 32x1024 by 1024x1024 multiply)")
    print(f"{'model':9} {'world':>5} {'kind':>28} {'median ms':>9} {'p90 ms':>8} "
          f"{'fwd':>6} {'bwd':>6} {'step':>6} {'x DDP':>6} {'range':>13}")
    for world, models in repeats[0].items():
        for model, r in models.items():
            for kind in r["stages"]:
                med = lambda stage: statistics.median(  # noqa: E731
                    rep[world][model]["stages"][kind][stage]["median"] * 1e3 for rep in repeats)
                p90 = statistics.median(rep[world][model]["stages"][kind]["total"]["p90"] * 1e3
                                        for rep in repeats)
                rs = ratios(repeats, world, model, kind)
                print(f"{model:9} {world:>5} {kind:>28} {med('total'):9.2f} {p90:8.2f} "
                      f"{med('forward'):6.1f} {med('backward'):6.1f} {med('step'):6.1f} "
                      f"{statistics.median(rs):6.3f} {min(rs):6.3f}-{max(rs):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--algorithms", default="gradient_allreduce,bytegrad",
                        help="comma-separated: " + ", ".join(ALGORITHMS) + " (each also as NAME@tcp)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per kind")
    parser.add_argument("--repeats", type=int, default=3, help="whole comparisons, fresh processes each")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--busy", type=int, default=0, help="extra processes spinning on the CPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_time.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    unknown = {k.split("@")[0] for k in args.algorithms.split(",")} - set(ALGORITHMS) - {"local"}
    if unknown or "local@tcp" in args.algorithms:
        parser.error(f"unknown algorithms {sorted(unknown or ['local@tcp'])}; choose from "
                     f"{sorted(ALGORITHMS)} or local")

    import tempfile

    from tqdm import tqdm

    sizes = [int(s) for s in args.world_sizes.split(",")]
    report = {"machine": machine(),
              "config": {"steps": args.steps, "repeats": args.repeats, "batch_per_rank": args.batch,
                         "busy_processes": args.busy, "algorithms": args.algorithms},
              "repeats": []}
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--batch", str(args.batch), "--algorithms", args.algorithms]
    with tempfile.TemporaryDirectory() as tmp, BusyLoad(args.busy):
        for _ in tqdm(range(args.repeats), desc="repeats"):
            report["repeats"].append({str(world): launch(__file__, world, Path(tmp) / f"world{world}.json",
                                                         worker_args) for world in sizes})
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
