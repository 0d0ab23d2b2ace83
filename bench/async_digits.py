"""Digits accuracy of AsyncModelAverage on a loaded machine, with and
without the staleness bound, next to GradientAllReduce (issue 18's run).

Runs examples/digits_mlp.py through bagua's launcher: 4 workers, 30 epochs,
SGD with momentum, sync_interval_ms=50 (--sync-interval-ms), no warmup, while --busy extra
processes spin on the CPU. Each rank's test accuracy is taken after
``abort(model)`` alone (--no-final-average: every rank keeps its own model),
so it shows how far each replica is from a good model; the drift figures of
every rank (stats()) come with it.

    /usr/bin/python3 bench/async_digits.py [--runs 5 --busy 2 --bounds default none]

Writes bench/results/async_digits.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import BusyLoad, free_port, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_example(algorithm, extra, results):
    subprocess.run([sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node", "4",
                    "--master_port", str(free_port()), str(ROOT / "examples" / "digits_mlp.py"),
                    "--algorithm", algorithm, "--epochs", "30", "--results", str(results), *extra],
                   check=True, timeout=900, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(results.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each asynchronous configuration")
    parser.add_argument("--busy", type=int, default=2, help="extra processes spinning on the CPU")
    parser.add_argument("--bounds", nargs="+", default=["default", "none"],
                        help="max_staleness_steps values to run ('default', 'none' or an integer)")
    parser.add_argument("--baseline-runs", type=int, default=1, help="GradientAllReduce runs")
    parser.add_argument("--sync-interval-ms", default="50", help="the asynchronous runs' averaging interval")
    parser.add_argument("--final-average", action="store_true",
                        help="end with abort(model, average=True) (every rank the same model)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_digits.json"))
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, BusyLoad(args.busy):
        tmp = Path(tmp)
        configs = [("gradient_allreduce", [], args.baseline_runs)] if args.baseline_runs else []
        for bound in args.bounds:
            extra = ["--sync-interval-ms", args.sync_interval_ms, "--warmup-steps", "0"]
            if not args.final_average:
                extra.append("--no-final-average")
            if bound != "default":
                extra += ["--max-staleness-steps", bound]
            configs.append((f"async_model_average bound={bound}", extra, args.runs))
        for name, extra, runs in configs:
            algorithm = name.split()[0]
            rows[name] = []
            for run in range(runs):
                metrics = run_example(algorithm, extra, tmp / f"{len(rows)}_{run}.json")
                rows[name].append(metrics)
                drift = metrics.get("async_stats") or {}
                print(f"{name} run {run + 1}: ranks {['%.4f' % a for a in metrics['rank_accuracies']]}, "
                      f"{metrics['train_seconds']:.1f} s, steps/round {drift.get('steps_per_round_mean')}, "
                      f"round ms {drift.get('round_ms_mean')}, drift {drift.get('drift')}", flush=True)
    summary = {name: {"min_rank_accuracy": min(min(m["rank_accuracies"]) for m in runs),
                      "median_seconds": statistics.median(m["train_seconds"] for m in runs)}
               for name, runs in rows.items() if runs}
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "runs": rows,
                                          "summary": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
