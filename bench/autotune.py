"""Autotuning's result against the default plan, on a toy model.

Each of 4 processes trains the same model twice in one run: once with
autotuning (BAGUA_AUTOTUNE trials of bucket sizes, then frozen), once with
the default bucket size. Then both are timed interleaved step by step (a
barrier before each step, each step's time the slowest rank's), and the step
time of the tuned plan is compared with the default's. The whole run (tuning
included) is repeated `--repeats` times in fresh processes; the spread of the
ratio over the repeats is printed.

    /usr/bin/python3 bench/autotune.py [--trials 8 --repeats 3]

Writes bench/results/autotune.json (with every trial) .
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_steps, launch, machine, quantiles  # noqa: E402


def worker(args):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()

    def build():
        torch.manual_seed(0)
        layers = []
        for i in range(24):
            layers += [torch.nn.Linear(256 if i == 0 else 192, 192), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(192, 10))

    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]

    def step(model, opt, i):
        x, y = data[i % len(data)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    tuned = build()
    tuned_opt = torch.optim.SGD(tuned.parameters(), lr=0.01)
    tuned = tuned.with_bagua([tuned_opt], GradientAllReduceAlgorithm(), autotune=True)
    i = 0
    start = time.perf_counter()
    while not tuned.bagua_ddp.autotuner.frozen:
        step(tuned, tuned_opt, i)
        i += 1
    tuning_seconds = time.perf_counter() - start
    default = build()
    default_opt = torch.optim.SGD(default.parameters(), lr=0.01)
    default = default.with_bagua([default_opt], GradientAllReduceAlgorithm())
    runs = {"default": (default, default_opt), "tuned": (tuned, tuned_opt)}
    interleaved_steps(runs, data, 5)
    samples = interleaved_steps(runs, data, args.steps)
    summary = {name: quantiles(stages["total"]) for name, stages in samples.items()}
    tuner = tuned.bagua_ddp.autotuner
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "step_seconds": summary, "trials": tuner.trials, "best": tuner.best,
            "default_bucket_bytes": default.bagua_ddp.bucket_bytes,
            "default_buckets": len(default.bagua_buckets), "tuned_buckets": len(tuned.bagua_buckets),
            "tuning_steps": i, "tuning_seconds": tuning_seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per plan")
    parser.add_argument("--repeats", type=int, default=3, help="whole runs, tuning included, fresh processes each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "autotune.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    from tqdm import tqdm

    os.environ.update({"BAGUA_AUTOTUNE_WARMUP_STEPS": "5", "BAGUA_AUTOTUNE_WINDOW_STEPS": "8",
                       "BAGUA_AUTOTUNE_MAX_TRIALS": str(args.trials)})
    repeats = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["BAGUA_AUTOTUNE_OUTPUT"] = str(Path(tmp) / "plan.json")
        for _ in tqdm(range(args.repeats), desc="repeats"):
            repeats.append(launch(__file__, args.world_size, Path(tmp) / "autotune.json",
                                  ["--steps", str(args.steps)]))
    for n, result in enumerate(repeats):
        print(f"repeat {n}: {result['tuning_steps']} tuning steps; trials (bucket bytes -> steps/s):")
        for trial in result["trials"]:
            print(f"  {trial['bucket_bytes']:>10} bytes, {trial['buckets']:>3} buckets: "
                  f"{trial['steps_per_second']:.2f} steps/s")
        s = result["step_seconds"]
        print(f"  default plan ({result['default_bucket_bytes']} bytes, {result['default_buckets']} buckets): "
              f"{s['default']['median'] * 1e3:.2f} ms/step (p90 {s['default']['p90'] * 1e3:.2f})")
        print(f"  tuned plan ({result['best']['bucket_bytes']} bytes, {result['tuned_buckets']} buckets): "
              f"{s['tuned']['median'] * 1e3:.2f} ms/step (p90 {s['tuned']['p90'] * 1e3:.2f}); "
              f"default / tuned = {s['default']['median'] / s['tuned']['median']:.3f}")
    ratios = [r["step_seconds"]["default"]["median"] / r["step_seconds"]["tuned"]["median"] for r in repeats]
    print(f"default / tuned over {len(ratios)} repeats: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "repeats": repeats,
                                          "default_over_tuned": ratios}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
