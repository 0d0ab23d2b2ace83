"""One bucket, two ops: GradientAllReduce's C_FP_S and ByteGrad's C_LP_S.

The communication part of a training step alone, without the model: each
rank holds one fp32 bucket of `--numel` elements per op, marks it ready and
waits for the op, as the runtime does at the end of backward. The two ops are
interleaved call by call with a barrier before each; a call's time is the
maximum over ranks. Prints the median, p10 and p90 per op and the ratio of
the medians, per repeat.

    source scripts/env.sh && /usr/bin/python3 bench/bucket_ops.py
    /usr/bin/python3 bench/bucket_ops.py --world-sizes 2,4 --numel 2621440 --repeats 3

Writes bench/results/bucket_ops.json.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402

OPS = ("c_fp_s", "c_lp_s")


def make_bucket(core, op, comm, tensor):
    bucket = core.Bucket(op, [(op + ".t", core.TensorView(tensor.data_ptr(), tensor.numel(), "float32", "cpu"))])
    if op == "c_fp_s":
        bucket.append_centralized_synchronous_op(comm, None, core.CentralizedSynchronousOptions(hierarchical=False))
    else:
        bucket.append_centralized_low_precision_op(
            comm, None, core.CentralizedLowPrecisionOptions(hierarchical=False))
    return bucket


def worker(args):
    import statistics

    import torch

    import bagua.torch_api as bagua
    import bagua_core as core

    torch.set_num_threads(1)
    bagua.init_process_group()
    # The communicator a model's buckets use, from a group of every rank.
    comm = bagua.new_group(list(range(bagua.get_world_size()))).get_bucket_communicator()
    tensors = {op: torch.randn(args.numel) for op in OPS}
    backends = {}
    for op in OPS:
        backends[op] = core.Backend(bagua.get_rank(), 60.0)
        backends[op].register_ordered_buckets([make_bucket(core, op, comm, tensors[op])])
    samples = {op: [] for op in OPS}
    for i in range(args.warmup + args.calls):
        for op in OPS:
            tensors[op].normal_()  # fresh gradients: the same work each call
            bagua.barrier()
            start = time.perf_counter()
            backends[op].mark_communication_ready(op + ".t")
            backends[op].wait_pending_comm_ops()
            if i >= args.warmup:
                samples[op].append(time.perf_counter() - start)
    slowest = torch.tensor([samples[op] for op in OPS], dtype=torch.float64)
    bagua.allreduce_inplace(slowest, op=bagua.ReduceOp.MAX)
    if bagua.get_rank() == 0:
        result = {}
        for j, op in enumerate(OPS):
            ordered = sorted(slowest[j].tolist())
            result[op] = {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
                          "p90": ordered[(9 * len(ordered)) // 10]}
        Path(args.out).write_text(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--numel", type=int, default=2_621_440, help="fp32 elements (default 10 MiB)")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bucket_ops.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import os
    import tempfile

    os.environ["BAGUA_CHECK_COLLECTIVES"] = "0"
    report = {"machine": machine(), "config": {"numel": args.numel, "calls": args.calls}, "results": {}}
    worker_args = ["--numel", str(args.numel), "--calls", str(args.calls), "--warmup", str(args.warmup)]
    print(f"{'world':>5} {'repeat':>6} {'op':>7} {'median ms':>9} {'p10 ms':>7} {'p90 ms':>7} {'x C_FP_S':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.world_sizes.split(",")):
            runs = []
            for repeat in range(args.repeats):
                run = launch(__file__, world, Path(tmp) / "out.json", worker_args)
                runs.append(run)
                base = run["c_fp_s"]["median"]
                for op, q in run.items():
                    print(f"{world:>5} {repeat:>6} {op:>7} {q['median'] * 1e3:9.3f} {q['p10'] * 1e3:7.3f} "
                          f"{q['p90'] * 1e3:7.3f} {q['median'] / base:8.3f}", flush=True)
            report["results"][str(world)] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
