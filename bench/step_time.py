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
is made): the transport before shared memory, in the same run. With
"@slots" the group's shared-memory allreduce always goes through the
segment's slots (BAGUA_SHARED_MEMORY_DIRECT=0), never direct between the
ranks' buffers.

Prints, per model and world size, each kind's median and p90 step time, the
median time of each stage (forward, backward with the communication wait,
optimizer step), and the ratio algorithm / DDP (< 1: faster than DDP) with
its range over the repeats; writes bench/results/step_time.json.

With --breakdown the workers record a timeline (BAGUA_TIMELINE, in a
temporary directory) and print, per rank, where each bagua kind's step
went (medians, and means, which add up to the mean step) next to
`local`'s: compute (step start to the last gradient
marked ready: zero_grad, forward, backward, the per-parameter hooks), the
bucket ops' time that ran during it (the communication thread's, taking
cycles from the backward pass), then after the last gradient the ops'
phases (the shared-memory allreduce marks copy in, reduce, copy out and
its waits) and the rest of the wait (hand-offs between threads), and the
optimizer step. The timeline costs a few microseconds per event.

    /usr/bin/python3 bench/step_time.py --algorithms gradient_allreduce,local --breakdown --repeats 1
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (BusyLoad, gather_json, interleaved_steps, interleaved_windows, launch,  # noqa: E402
                    machine, quantiles, step_window)

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


# A suffix's group: every communicator of it made with this variable set.
TRANSPORTS = {"tcp": "BAGUA_SHARED_MEMORY", "slots": "BAGUA_SHARED_MEMORY_DIRECT"}


def group_with(variable):
    """A group of all ranks whose communicators are made with ``variable``=0
    (BAGUA_SHARED_MEMORY: never shared memory; BAGUA_SHARED_MEMORY_DIRECT:
    the shared-memory allreduce through its slots, never direct)."""
    import os

    import bagua.torch_api as bagua
    from bagua.torch_api._core import core

    import torch

    from bagua.torch_api._core import tensor_view

    os.environ[variable] = "0"
    core._testing.reload_env()
    try:
        group = bagua.new_group(list(range(bagua.get_world_size())))
        # made now, while the variable says so; its first collective sets up
        # the shared-memory group, which reads the variables then
        probe = torch.zeros(1)  # alive while the view of it is used
        view = tensor_view(probe, "probe")
        for comm in (group.get_global_communicator(), group.get_bucket_communicator()):
            comm.allreduce(view, view, "sum")
    finally:
        del os.environ[variable]
        core._testing.reload_env()
    return group


def make_run(kind, spec, groups):
    import torch

    torch.manual_seed(0)
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "local":
        pass  # no communication at all: the floor
    else:
        group = groups.get(kind.partition("@")[2]) if "@" in kind else None
        model = model.with_bagua([opt], make_algorithm(kind), process_group=group)
    return model, opt


def summarize(samples):
    """{kind: {stage: [s]}} -> {kind: {stage: {median, p90}}}."""
    return {kind: {stage: quantiles(values) for stage, values in stages.items()}
            for kind, stages in samples.items()}



def _overlap(event, lo, hi):
    """Microseconds of the span ``event`` inside [lo, hi)."""
    return max(0, min(event["ts"] + event.get("dur", 0), hi) - max(event["ts"], lo))


def step_parts(events, start_us, end_us):
    """Where one bagua step went on this rank (ms): see the module docstring.
    ``ops_during_compute`` overlaps ``compute``; the parts after it add up
    to the step."""
    window = step_window(events, start_us, end_us)
    if window is None:
        return None
    inside, last_ready, backward_end = window
    ops = [e for e in inside if e.get("cat") == "comm_op"]
    phases = [e for e in inside if e.get("cat") == "op_phase"]
    row = {"compute": last_ready - start_us,
           "ops_during_compute": sum(_overlap(e, start_us, last_ready) for e in ops)}
    exposed = 0
    for e in phases or ops:  # an op's phases when it marks them
        took = _overlap(e, last_ready, backward_end)
        row[e["name"]] = row.get(e["name"], 0) + took
        exposed += took
    if phases:  # the op's own time outside its phases (its other work)
        rest = sum(_overlap(e, last_ready, backward_end) for e in ops) - exposed
        row["op_outside_phases"] = rest
        exposed += rest
    row["waiting"] = backward_end - last_ready - exposed
    row["optimizer"] = sum(e["dur"] for e in inside if e.get("cat") == "phase" and e["name"] == "optimizer_step")
    row["other"] = end_us - backward_end - row["optimizer"]
    row["ops_whole_step"] = sum(e.get("dur", 0) for e in ops)
    return {k: v / 1e3 for k, v in row.items()}


def breakdowns(events, windows, stages, skip):
    """Per kind, the median over the steps after ``skip`` of each part (ms,
    this rank); for kinds without a timeline (DDP, local) their stages."""
    import statistics

    result = {}
    for kind, spans in windows.items():
        rows = [r for r in (step_parts(events, a, b) for a, b in spans[skip:]) if r]
        if rows:
            parts = list(dict.fromkeys(k for r in rows for k in r))
            result[kind] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in parts}
            # means add up (medians do not: a lost time slice lands in one part or another)
            result[f"{kind} (mean)"] = {k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in parts}
            result[f"{kind} (mean)"]["step_this_rank"] = statistics.fmean(b - a for a, b in spans[skip:]) / 1e3
        else:  # the slowest rank's stages
            result[kind] = {"compute_slowest_rank": statistics.median(
                f + b for f, b in zip(stages[kind]["forward"][skip:], stages[kind]["backward"][skip:])) * 1e3,
                "optimizer_slowest_rank": statistics.median(stages[kind]["step"][skip:]) * 1e3}
        result[kind]["step_this_rank"] = statistics.median(b - a for a, b in spans[skip:]) / 1e3
        if not rows:
            result[f"{kind} (mean)"] = {
                "step_this_rank": statistics.fmean(b - a for a, b in spans[skip:]) / 1e3}
    return result



def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api import timeline

    kinds = ["ddp"] + args.algorithms.split(",")
    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    groups = {suffix: group_with(variable) for suffix, variable in TRANSPORTS.items()
              if f"@{suffix}" in args.algorithms}
    results = {}
    for model_name, spec in MODELS.items():
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(args.batch, spec["input"], generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(8)]
        runs = {kind: make_run(kind, spec, groups) for kind in kinds}
        interleaved_steps(runs, batches, args.warmup)  # includes bagua's profiling iteration
        clock = timeline.get(rank)  # with --breakdown (BAGUA_TIMELINE set)
        if clock is None:
            samples = interleaved_steps(runs, batches, args.steps)
        else:
            samples, windows = interleaved_windows(runs, batches, args.steps, clock)
        params = build_model(spec).parameters()
        results[model_name] = {"stages": summarize(samples), "tensors": len(list(params))}
        if clock is not None:
            events = json.loads(clock.to_json())["traceEvents"]
            results[model_name]["breakdown"] = gather_json(breakdowns(events, windows, samples, 0))
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


def print_breakdown(report):
    """Each rank's median step of each kind, by part (ms), per repeat."""
    for i, rep in enumerate(report["repeats"]):
        for world, models in rep.items():
            for model, r in models.items():
                for rank, parts in enumerate(r.get("breakdown", [])):
                    for kind, row in parts.items():
                        if kind.startswith("ddp"):
                            continue
                        print(f"repeat {i} {model} world {world} {kind:>18} rank {rank}: "
                              + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))


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
                        help="comma-separated: " + ", ".join(ALGORITHMS) + " (each also as NAME@tcp, NAME@slots)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per kind")
    parser.add_argument("--repeats", type=int, default=3, help="whole comparisons, fresh processes each")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--busy", type=int, default=0, help="extra processes spinning on the CPU")
    parser.add_argument("--breakdown", action="store_true",
                        help="record a timeline and print where each bagua step went, by rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_time.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    kinds = args.algorithms.split(",")
    unknown = {k.split("@")[0] for k in kinds} - set(ALGORITHMS) - {"local"}
    unknown |= {k for k in kinds if "@" in k and (k.startswith("local") or k.split("@")[1] not in TRANSPORTS)}
    if unknown:
        parser.error(f"unknown algorithms {sorted(unknown)}; choose from "
                     f"{sorted(ALGORITHMS)} or local")

    import os
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
        if args.breakdown:
            os.environ["BAGUA_TIMELINE"] = str(Path(tmp) / "timeline")  # the workers inherit it
        for _ in tqdm(range(args.repeats), desc="repeats"):
            report["repeats"].append({str(world): launch(__file__, world, Path(tmp) / f"world{world}.json",
                                                         worker_args) for world in sizes})
    print_table(report)
    if args.breakdown:
        print_breakdown(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
