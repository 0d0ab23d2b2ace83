"""Worker scenarios of test_shared_memory.py, run on several processes by
launcher.run_workers. Usage: shm_workers.py SCENARIO OUT_DIR; each rank
saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import bagua.torch_api as bagua


def _save(results, out_dir):
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def _maps_a_segment() -> bool:
    """Whether this process maps a segment of the shared-memory collectives
    (not the P-Reduce's mailboxes, which every group on one host has)."""
    with open("/proc/self/maps") as maps:
        return any("/dev/shm/bagua-collectives-" in line for line in maps)


def scenario_allreduce(out_dir):
    """Large allreduces (shared memory unless BAGUA_SHARED_MEMORY=0) against
    closed forms and against torch.distributed's Gloo allreduce."""
    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    results = {}
    for dtype in (torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16):
        x = torch.full((300_001,), rank + 1, dtype=dtype)
        bagua.allreduce_inplace(x)
        results[f"sum_{dtype}"] = bool((x == n * (n + 1) // 2).all())
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(1_000_003, generator=g)
    ours, theirs = mine.clone(), mine.clone()
    bagua.allreduce_inplace(ours, op=bagua.ReduceOp.AVG)
    dist.all_reduce(theirs)
    theirs /= n
    results["max_abs_diff_vs_torch"] = (ours - theirs).abs().max().item()
    gathered = torch.zeros(n, ours.numel())
    bagua.allgather(ours, gathered)
    results["identical_on_all_ranks"] = bool((gathered == ours).all())
    results["maps_segment"] = _maps_a_segment()
    _save(results, out_dir)


def scenario_peer_dies(out_dir):
    """Rank 1 kills itself in the middle of a series of allreduces; the others
    must fail fast, naming it."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    x = torch.ones(2_000_000)
    started = time.monotonic()
    try:
        for i in range(1000):
            if rank == 1 and i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            bagua.allreduce_inplace(x)
            x.fill_(1.0)
        error = None
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        error = f"{type(e).__name__}: {e}"
    _save({"error": error, "seconds": time.monotonic() - started}, out_dir)
    sys.stdout.flush()
    os._exit(0)  # the dead peer's sockets would only slow a clean shutdown


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
