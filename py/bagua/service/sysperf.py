"""``python -m bagua.distributed.launch ... -m bagua.service.sysperf``: the
benchmark that :func:`bagua.service.autotune_system_hyperparameters` scores
a communication setting with.

Every rank allreduces a few gradient-sized float32 buffers through
``bagua.torch_api`` (one "step" is one allreduce of each buffer), first
checks one allreduce's result, then times ``--steps`` steps. A step lasts
as long as its slowest rank, so each step's time is the maximum over ranks.
Rank 0 prints one line, :data:`RESULT_PREFIX` followed by a JSON object:

    world_size, backend, bytes_per_step, steps,
    step_s (mean), step_s_std, throughput_mb_s (bytes_per_step / step_s / 1e6)

Under ``BAGUA_BACKEND=nccl`` the buffers are on the GPU ``LOCAL_RANK``.
"""

import argparse
import json
import statistics
import sys
import time
from typing import List, Optional

RESULT_PREFIX = "bagua-sysperf-result: "


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bagua.service.sysperf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer_mib", default="0.0625,0.25,1,4",
                        help="sizes of the buffers allreduced in each step, in MiB, comma separated")
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        args.buffer_mib = [float(size) for size in args.buffer_mib.split(",")]
    except ValueError:
        parser.error(f"--buffer_mib: expected numbers separated by commas, got {args.buffer_mib!r}")
    if not args.buffer_mib or min(args.buffer_mib) <= 0 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("--buffer_mib must be positive sizes, --steps >= 1 and --warmup_steps >= 0")
    return args


def _device():
    import torch
    from bagua.torch_api import env
    import bagua_core

    if bagua_core.env().backend == "nccl":
        torch.cuda.set_device(env.get_local_rank())
        return torch.device("cuda", env.get_local_rank())
    return torch.device("cpu")


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(buffer_mib: List[float], warmup_steps: int, steps: int) -> Optional[dict]:
    """Runs the benchmark on this rank; rank 0 gets the result, the others None."""
    import torch
    import bagua.torch_api as bagua

    bagua.init_process_group()
    device = _device()
    buffers = [torch.ones(max(1, int(mib * 2 ** 20) // 4), dtype=torch.float32, device=device) for mib in buffer_mib]

    # A setting that gives wrong sums must not win on speed.
    for buffer in buffers:
        buffer.fill_(1.0)
        bagua.allreduce_inplace(buffer)
    _synchronize(device)
    if not all(bool((buffer == bagua.get_world_size()).all()) for buffer in buffers):
        raise RuntimeError(f"sysperf: rank {bagua.get_rank()}: an allreduce of ones did not sum to the world size")

    step_times = []
    for step in range(warmup_steps + steps):
        bagua.barrier()  # every rank starts the step together
        started = time.perf_counter()
        for buffer in buffers:
            bagua.allreduce_inplace(buffer)
        _synchronize(device)
        if step >= warmup_steps:
            step_times.append(time.perf_counter() - started)

    slowest = torch.tensor(step_times, dtype=torch.float64)
    bagua.allreduce_inplace(slowest, op=bagua.ReduceOp.MAX)
    if bagua.get_rank() != 0:
        return None
    times = slowest.tolist()
    bytes_per_step = sum(buffer.numel() * buffer.element_size() for buffer in buffers)
    step_s = statistics.mean(times)
    return {
        "world_size": bagua.get_world_size(),
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "bytes_per_step": bytes_per_step,
        "steps": steps,
        "step_s": step_s,
        "step_s_std": statistics.pstdev(times),
        "throughput_mb_s": bytes_per_step / step_s / 1e6,
    }


def parse_result(output: str) -> Optional[dict]:
    """The result in a run's output (the last result line), or None."""
    result = None
    for line in output.splitlines():
        # Under ssh -tt the line may carry a carriage return, or the host's prefix.
        position = line.find(RESULT_PREFIX)
        if position >= 0:
            result = json.loads(line[position + len(RESULT_PREFIX):].strip())
    return result


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    result = measure(args.buffer_mib, args.warmup_steps, args.steps)
    if result is not None:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
