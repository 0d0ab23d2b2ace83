"""Worker scenario of test_gpu.py, run on several processes sharing one GPU
by launcher.run_workers. Usage: gpu_workers.py bucket_ops OUT_DIR [cpu];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import bagua_core
import torch

from bucket_op_harness import OPS, run_bucket_op


def scenario_bucket_ops(out_dir, devices="cpu,cuda"):
    """Every op, fp32 and fp16, on this rank's own data, first on a CPU
    bucket and then on a CUDA bucket, each over its own Gloo communicator
    (staged through host memory for CUDA). Saves {op-dtype: (cpu results,
    cuda results)}, each the bucket after every step followed by the op's
    extra buffers."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(os.path.join(out_dir, "store"), exist_ok=True)
    store = bagua_core.file_store(os.path.join(out_dir, "store"))
    results = {}
    for op in OPS:
        for dtype in (torch.float32, torch.float16):
            key = f"{op}-{str(dtype).split('.')[-1]}"
            data = (torch.randn(70001, generator=torch.Generator().manual_seed(7 + rank)) * 2).to(dtype)
            runs = []
            for device in devices.split(","):
                comm = bagua_core.gloo_communicator(store, rank, world, prefix=f"{key}-{device}")
                steps, extra = run_bucket_op(device, data, op, comm, rank=rank)
                runs.append(steps + extra)
            results[key] = (runs[0], runs[1] if len(runs) > 1 else None)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir, *args = sys.argv[1:]
    if scenario != "bucket_ops":
        raise SystemExit(f"unknown scenario {scenario}")
    scenario_bucket_ops(out_dir, *args)
