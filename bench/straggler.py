"""One straggler: epoch time of GradientAllReduce, Decentralized and
AsyncModelAverage side by side (the Bagua paper's straggler experiment, on
CPU).

4 processes train the same MLP on their shards of the same data; rank 3 sleeps
--delay-ms after each of its steps, as a slow worker would. Every rank also
spends --work-ms per step outside the model (data loading). For each
algorithm, in one run and the same processes, each rank's time for one epoch
(its shard, --steps steps) is measured with nobody slowed and with the
straggler, alternating, --repeats times each (each rank's fastest counts); the table shows the fast ranks' median and the slowest
rank's time, and how much of their unslowed speed the fast ranks keep
(epoch time without the straggler / with it). AsyncModelAverage runs with
its default staleness bound and unbounded (max_staleness_steps=None).

    /usr/bin/python3 bench/straggler.py [--delay-ms 40 --steps 60 --busy 0]

Writes bench/results/straggler.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import BusyLoad, launch, machine  # noqa: E402

ALGORITHMS = ["gradient_allreduce", "decentralized_ring", "decentralized_shift_one", "async_model_average",
              "async_model_average_unbounded"]


def worker(args):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import async_model_average, decentralized, gradient_allreduce

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    make = {
        "gradient_allreduce": lambda: gradient_allreduce.GradientAllReduceAlgorithm(),
        "decentralized_ring": lambda: decentralized.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode="ring"),
        "decentralized_shift_one": lambda: decentralized.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode="shift_one"),
        "async_model_average": lambda: async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=50),
        "async_model_average_unbounded": lambda: async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=50, max_staleness_steps=None),
    }
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(args.steps)]
    results = {}
    for name in ALGORITHMS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        algorithm = make[name]()
        model = model.with_bagua([opt], algorithm)
        # Phases alternate --repeats times; each rank keeps its fastest epoch
        # of each, so a burst of other load on the shared machine does not
        # decide the ratio.
        times = torch.full((2, world), float("inf"), dtype=torch.float64)
        for _ in range(args.repeats):
            for phase, straggle in enumerate((False, True)):
                bagua.barrier()
                start = time.perf_counter()
                for x, y in data:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    time.sleep(args.work_ms / 1000)
                    if straggle and rank == world - 1:
                        time.sleep(args.delay_ms / 1000)
                times[phase, rank] = min(times[phase, rank].item(), time.perf_counter() - start)
        times[:, [r for r in range(world) if r != rank]] = 0
        if hasattr(algorithm, "abort"):
            drift = algorithm.stats(model)
            algorithm.abort(model)
            times = torch.cat([times, torch.zeros(3, world, dtype=torch.float64)])
            times[2:, rank] = torch.tensor([drift["steps_per_round"]["mean"], drift["round_ms"]["mean"],
                                            drift["staleness_wait_ms"]], dtype=torch.float64)
        bagua.allreduce_inplace(times)
        results[name] = times.tolist()
        model.without_bagua()
        bagua.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch per rank")
    parser.add_argument("--delay-ms", type=float, default=40.0, help="the straggler's extra time per step")
    parser.add_argument("--work-ms", type=float, default=5.0, help="per-step time outside the model")
    parser.add_argument("--repeats", type=int, default=3, help="epochs of each phase (the fastest counts)")
    parser.add_argument("--busy", type=int, default=0, help="extra processes spinning on the CPU meanwhile")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "straggler.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    worker_args = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--delay-ms", str(args.delay_ms),
                   "--work-ms", str(args.work_ms)]
    with tempfile.TemporaryDirectory() as tmp, BusyLoad(args.busy):
        times = launch(__file__, args.world_size, Path(tmp) / "straggler.json", worker_args)
    print(f"epoch of {args.steps} steps per rank, rank {args.world_size - 1} {args.delay_ms:.0f} ms slower per step"
          f", {args.busy} busy processes")
    print(f"{'algorithm':>30} {'fast s (no straggler)':>22} {'fast s':>7} {'straggler s':>12} "
          f"{'GA / this (fast)':>17} {'speed kept':>11}")
    baseline = statistics.median(times["gradient_allreduce"][1][:-1])
    rows = {}
    for name, table in times.items():
        unslowed, per_rank = table[0], table[1]
        fast, fast_unslowed = statistics.median(per_rank[:-1]), statistics.median(unslowed[:-1])
        rows[name] = {"fast_ranks_s": fast, "fast_ranks_no_straggler_s": fast_unslowed,
                      "straggler_s": per_rank[-1], "per_rank_s": per_rank, "per_rank_no_straggler_s": unslowed,
                      "speedup_fast_ranks_vs_gradient_allreduce": baseline / fast,
                      "fast_ranks_speed_kept": fast_unslowed / fast}
        if len(table) > 2:  # asynchronous: the drift figures of each rank
            rows[name].update(steps_per_round=table[2], round_ms=table[3], staleness_wait_ms=table[4])
        print(f"{name:>30} {fast_unslowed:22.2f} {fast:7.2f} {per_rank[-1]:12.2f} {baseline / fast:17.2f} "
              f"{fast_unslowed / fast:11.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "results": rows},
                                         indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
