"""What algorithm="auto" costs before it has chosen: its first steps against
the same number of steps of its choice, given directly (issue 43, point 2).

2 ranks, each in its own network namespace with its egress shaped by tbf to
the rate (bench/netns.py; needs root). Every kind trains the issue's MLP
512-1536-1536-1024-10 (4.7 M parameters; batch 32 of random inputs, the
same per rank for every kind) from the same weights: auto, and its
slow-link candidates PowerSGD and 8-bit PowerSGD at rank 1 given directly.
All run with ``start_iter=0`` (auto's ``powersgd_start_iter=0``), so what
auto's measuring costs is not hidden behind PowerSGD's uncompressed first
steps. The kinds are interleaved step by step with a barrier before each; a
step's time is the slowest rank's. GradientAllReduce and ByteGrad, which
auto does not choose on these links, are not run (a full precision step at
10 Mbit/s takes 15 s).

Prints, per rate, the seconds of auto's first --steps steps, the same for
the kind it chose, their ratio (goal: at most 3), auto's decisions, and the
chosen kind's median step after auto settled against auto's own (the
steady state); writes the JSON report (--out).

    /usr/bin/python3 bench/auto_first_steps.py --rates 10,100
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_windows, machine, quantiles  # noqa: E402

WIDTHS = (512, 1536, 1536, 1024, 10)
KINDS = ("auto", "powersgd", "powersgd_8bit")


def make_run(kind):
    import torch

    from bagua.torch_api.algorithms.auto import AutoAlgorithm
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    algorithm = {"auto": lambda: AutoAlgorithm(powersgd_rank=1, powersgd_start_iter=0),
                 "powersgd": lambda: PowerSGDAlgorithm(rank=1, start_iter=0, one_bucket=True),
                 "powersgd_8bit": lambda: PowerSGDAlgorithm(rank=1, start_iter=0, low_precision=True,
                                                            one_bucket=True)}[kind]()
    return model.with_bagua([opt], algorithm), opt


def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.auto import AutoAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(32, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (32,), generator=g))
               for _ in range(8)]
    runs = {kind: make_run(kind) for kind in KINDS}
    samples, _ = interleaved_windows(runs, batches, args.steps + args.steady_steps)
    if rank == 0:
        result = {kind: samples[kind]["total"] for kind in KINDS}
        Path(args.out).write_text(json.dumps({"steps": result,
                                              "decisions": AutoAlgorithm.decisions(runs["auto"][0])}))


def summarize(rate, report, steps):
    decisions = report["decisions"]
    choice = decisions[-1]["choice"]
    first = {kind: sum(times[:steps]) for kind, times in report["steps"].items()}
    steady = {kind: quantiles(times[steps:])["median"] for kind, times in report["steps"].items()}
    summary = {"rate_mbit": rate, "choice": choice, "first_steps_s": first, "steady_median_s": steady,
               "decisions": [(d["step"], d["choice"]) for d in decisions]}
    if choice in first:
        summary["first_steps_ratio"] = first["auto"] / first[choice]
        summary["steady_ratio"] = steady["auto"] / steady[choice]
    print(f"{rate} Mbit/s: auto chose {choice}; decisions (step, choice) {summary['decisions']}")
    for kind in KINDS:
        print(f"  {kind:14s} first {steps} steps {first[kind]:7.3f} s   median step after {1000 * steady[kind]:7.1f} ms")
    if "first_steps_ratio" in summary:
        print(f"  auto's first {steps} steps / {choice}'s: {summary['first_steps_ratio']:.2f}x (goal <= 3); "
              f"after: {summary['steady_ratio']:.3f}x", flush=True)
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,100", help="Mbit/s, comma separated")
    parser.add_argument("--steps", type=int, default=16, help="the first steps compared")
    parser.add_argument("--steady-steps", type=int, default=12, help="steps after them, for the steady state")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "auto_first_steps.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from netns import emulated_hosts, launch_on_hosts

    report = {"machine": machine(), "steps": args.steps, "rates": []}
    for rate in [int(r) for r in args.rates.split(",")]:
        with tempfile.TemporaryDirectory() as tmp, emulated_hosts(2, rates_mbit={0: rate, 1: rate}) as hosts:
            out = Path(tmp) / "result.json"
            result = launch_on_hosts(__file__, hosts, out, ["--steps", str(args.steps),
                                                            "--steady-steps", str(args.steady_steps)])
        entry = summarize(rate, result, args.steps)
        entry["raw"] = result
        report["rates"].append(entry)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
