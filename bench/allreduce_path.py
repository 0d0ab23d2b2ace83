"""One allreduce, by transport: PyTorch's Gloo, bagua over loopback TCP
(Gloo's ring, as before shared memory), bagua through shared memory
(direct between the ranks' buffers from 64 KiB on) and bagua through the
shared-memory segment's slots (BAGUA_SHARED_MEMORY_DIRECT=0).

Same processes, same buffers, interleaved call by call with a barrier before
each; a call's time is the maximum over ranks; the table gives the median
and p90 per message size and the ratio to PyTorch's.

    /usr/bin/python3 bench/allreduce_path.py                  # world sizes 2 and 4
    /usr/bin/python3 bench/allreduce_path.py --world-sizes 2 --sizes 1048576

Writes bench/results/allreduce_path.json.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine, quantiles  # noqa: E402

KINDS = ("torch_gloo", "bagua_tcp", "bagua_shared_memory", "bagua_shared_memory_slots")


def worker(args):
    import torch
    import torch.distributed as dist

    import bagua.torch_api as bagua
    from bagua.torch_api.communication import allreduce_inplace
    from step_time import group_with

    torch.set_num_threads(1)
    bagua.init_process_group()
    tcp = group_with("BAGUA_SHARED_MEMORY")
    slots = group_with("BAGUA_SHARED_MEMORY_DIRECT")
    calls = {
        "torch_gloo": lambda t: dist.all_reduce(t),
        "bagua_tcp": lambda t: allreduce_inplace(t, comm=tcp),
        "bagua_shared_memory": lambda t: allreduce_inplace(t),
        "bagua_shared_memory_slots": lambda t: allreduce_inplace(t, comm=slots),
    }
    results = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        buffers = {kind: torch.randn(nbytes // 4) for kind in KINDS}
        samples = {kind: [] for kind in KINDS}
        for i in range(args.warmup + args.calls):
            for kind in KINDS:
                bagua.barrier()
                start = time.perf_counter()
                calls[kind](buffers[kind])
                if i >= args.warmup:
                    samples[kind].append(time.perf_counter() - start)
        slowest = torch.tensor([samples[k] for k in KINDS], dtype=torch.float64)
        bagua.allreduce_inplace(slowest, op=bagua.ReduceOp.MAX)
        results[str(nbytes)] = {k: quantiles(slowest[j].tolist()) for j, k in enumerate(KINDS)}
    if bagua.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="65536,1048576,8388608,33554432", help="bytes, comma-separated")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce_path.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import os
    import tempfile

    os.environ["BAGUA_CHECK_COLLECTIVES"] = "0"  # time the allreduce alone, like torch's
    report = {"machine": machine(), "config": {"calls": args.calls}, "results": {}}
    worker_args = ["--sizes", args.sizes, "--calls", str(args.calls), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.world_sizes.split(",")):
            report["results"][str(world)] = launch(__file__, world, Path(tmp) / "out.json", worker_args)
    print(f"\n{'world':>5} {'bytes':>10} {'kind':>20} {'median ms':>9} {'p90 ms':>8} {'x torch':>7}")
    for world, sizes in report["results"].items():
        for nbytes, kinds in sizes.items():
            base = kinds["torch_gloo"]["median"]
            for kind, q in kinds.items():
                print(f"{world:>5} {nbytes:>10} {kind:>20} {q['median'] * 1e3:9.3f} {q['p90'] * 1e3:8.3f} "
                      f"{q['median'] / base:7.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
