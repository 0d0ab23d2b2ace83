"""Autotuning's result against the default plan, on a toy model.

Each of 4 processes trains the same model twice in one run: once with
autotuning (BAGUA_AUTOTUNE trials of bucket sizes, then frozen), once with
the default bucket size. Then both are timed in alternating rounds, and the
step time of the tuned plan is compared with the default's.

    /usr/bin/python3 bench/autotune.py [--trials 8]

Writes bench/results/autotune.json (with every trial) .
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine, median_slowest  # noqa: E402


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
    for k in range(5):
        step(default, default_opt, k)
        step(tuned, tuned_opt, k)
    samples = {"tuned": [], "default": []}
    for _ in range(args.rounds):
        for name, (model, opt) in (("default", (default, default_opt)), ("tuned", (tuned, tuned_opt))):
            bagua.barrier()
            for k in range(args.steps):
                t0 = time.perf_counter()
                step(model, opt, k)
                samples[name].append(time.perf_counter() - t0)
    summary = median_slowest(samples)
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
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "autotune.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    os.environ.update({"BAGUA_AUTOTUNE_WARMUP_STEPS": "5", "BAGUA_AUTOTUNE_WINDOW_STEPS": "8",
                       "BAGUA_AUTOTUNE_MAX_TRIALS": str(args.trials)})
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["BAGUA_AUTOTUNE_OUTPUT"] = str(Path(tmp) / "plan.json")
        result = launch(__file__, args.world_size, Path(tmp) / "autotune.json",
                        ["--steps", str(args.steps), "--rounds", str(args.rounds)])
    print("trials (bucket bytes -> steps/s):")
    for trial in result["trials"]:
        print(f"  {trial['bucket_bytes']:>10} bytes, {trial['buckets']:>3} buckets: "
              f"{trial['steps_per_second']:.2f} steps/s")
    s = result["step_seconds"]
    print(f"default plan ({result['default_bucket_bytes']} bytes, {result['default_buckets']} buckets): "
          f"{s['default'] * 1e3:.2f} ms/step")
    print(f"tuned plan ({result['best']['bucket_bytes']} bytes, {result['tuned_buckets']} buckets): "
          f"{s['tuned'] * 1e3:.2f} ms/step; default / tuned = {s['default'] / s['tuned']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), **result}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
