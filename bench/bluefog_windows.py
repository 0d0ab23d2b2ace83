"""One-sided window calls against the number of neighbours they reach.

`bf.win_put`, `bf.win_accumulate` and `bf.win_get` of a window of `--bytes`
(float32) on local processes, each call made to ONE neighbour and to ALL of
this rank's neighbours (out-neighbours for put and accumulate, in-neighbours
for get) of a fully connected graph, the kinds interleaved call by call with
a barrier before each. A call's time is the slowest rank's; reported: the
median and p90 over `--calls` calls, and all / one, which is the number of
neighbours if a call reaches them one after the other and near 1 if it
reaches them at once.

    /usr/bin/python3 bench/bluefog_windows.py [--sizes 4 --bytes 4096,1048576 --calls 60]

Writes bench/results/bluefog_windows.json (or --out).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine, quantiles  # noqa: E402

OPS = ("win_put", "win_accumulate", "win_get")


def one_call(bf, op, name, x, peers):
    weights = {p: 1.0 for p in peers}
    if op == "win_get":
        bf.win_get(name, src_weights=weights)
    else:
        getattr(bf, op)(x, name, dst_weights=weights)


def worker(args):
    import torch

    import bagua.bluefog as bf
    from bagua.bluefog import topology_util

    torch.set_num_threads(1)
    bf.init(topology_util.FullyConnectedGraph)
    rank, size = bf.rank(), bf.size()
    results = {}
    for nbytes in [int(b) for b in args.bytes.split(",")]:
        x = torch.ones(nbytes // 4)
        name = f"w{nbytes}"
        bf.win_create(x, name)
        peers = {"one": [(rank + 1) % size], "all": [r for r in range(size) if r != rank]}
        samples = {f"{op} {reach}": [] for op in OPS for reach in peers}
        for i in range(args.warmup + args.calls):
            for op in OPS:
                for reach, ranks in peers.items():
                    if op == "win_get":  # in-neighbours: the ones that put to this rank
                        ranks = [(rank - 1) % size] if reach == "one" else ranks
                    bf.barrier()
                    start = time.perf_counter()
                    one_call(bf, op, name, x, ranks)
                    if i >= args.warmup:
                        samples[f"{op} {reach}"].append(time.perf_counter() - start)
        bf.barrier()
        bf.win_free(name)
        slowest = {}
        for kind, times in samples.items():
            t = torch.tensor(times, dtype=torch.float64)
            slowest[kind] = bf.allgather(t.view(1, -1)).max(dim=0).values.tolist()
        results[str(nbytes)] = {kind: quantiles(times) for kind, times in slowest.items()}
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4", help="comma-separated world sizes")
    parser.add_argument("--bytes", default="4096,1048576", help="comma-separated window sizes in bytes")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bluefog_windows.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    report = {"machine": machine(), "config": {"calls": args.calls, "bytes": args.bytes}, "worlds": {}}
    worker_args = ["--bytes", args.bytes, "--calls", str(args.calls), "--warmup", str(args.warmup)]
    print(f"{'ranks':>5} {'bytes':>8} {'op':>15} {'one ms':>8} {'all ms':>8} {'all p90':>8} {'all / one':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(s) for s in args.sizes.split(",")]:
            result = launch(__file__, world, Path(tmp) / f"world{world}.json", worker_args)
            report["worlds"][str(world)] = result
            for nbytes, kinds in result.items():
                for op in OPS:
                    one, every = kinds[f"{op} one"], kinds[f"{op} all"]
                    print(f"{world:>5} {nbytes:>8} {op:>15} {one['median'] * 1e3:8.3f} "
                          f"{every['median'] * 1e3:8.3f} {every['p90'] * 1e3:8.3f} "
                          f"{every['median'] / one['median']:9.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
