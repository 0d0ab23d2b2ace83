import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
"""Worker scenarios of test_upstream_compat.py: what Bagua's master-branch
tests ask of a communicator after ``abort()`` and of torch's process groups
patched by bagua. Run on several processes by launcher.run_workers.

Usage: upstream_workers.py SCENARIO OUT_DIR; each rank saves its results to
OUT_DIR/rank{RANK}.pt.
"""

import os
import threading
import time

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.torch_api import communication

ABORT_AFTER_S = 1.0


def _save(results, rank, out_dir):
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _error_of(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return type(error).__name__
    return None


def _abort_later(comm):
    thread = threading.Thread(target=lambda: (time.sleep(ABORT_AFTER_S), comm.abort()))
    thread.start()
    return thread


def scenario_abort(out_dir):
    """Bagua's test_abort on the CPU: one allreduce that every rank joins,
    then ranks 1.. start a second one that rank 0 never joins; abort() from
    another thread must end it, and later calls must do nothing."""
    bagua.init_process_group()
    rank, comm = bagua.get_rank(), communication._get_default_group().get_global_communicator()
    first = torch.full((4,), float(rank))
    comm.allreduce_inplace(first.ensure_bagua_tensor().bagua_backend_tensor(), communication.ReduceOp.AVG)
    aborter = _abort_later(comm)
    blocked = torch.full((4,), 7.0)
    started = time.monotonic()
    if rank > 0:  # the runtime's view of the tensor, as Bagua's test passes it
        comm.allreduce_inplace(blocked.ensure_bagua_tensor().bagua_backend_tensor(), communication.ReduceOp.AVG)
    blocked_s = time.monotonic() - started
    aborter.join()
    later, out = torch.ones(4), torch.full((4,), -1.0)
    started = time.monotonic()
    comm.allreduce_inplace(later)  # Bagua's method on a torch tensor
    bagua.allreduce(later, out, comm=comm)  # a primitive
    bagua.broadcast(later, 0)  # a primitive on the default group
    _save({"first": first, "blocked": blocked, "blocked_s": blocked_s, "later": later, "out": out,
           "later_s": time.monotonic() - started, "check_abort": comm.check_abort(),
           "bad_root": _error_of(lambda: bagua.broadcast(later, 99, comm=comm))}, rank, out_dir)


def _sum_over(group_comm, rank):
    tensor = torch.full((3,), float(rank))
    group_comm.allreduce_inplace(tensor)
    return tensor


def scenario_torch_group_patch(out_dir):
    """``bagua_patch`` on torch groups: a subgroup patched by its members
    alone (rank 0 is not one), the world group by every rank; destroying
    them empties ``_torch_to_bagua_pg_map``."""
    bagua.init_process_group()
    rank, pg_map = dist.get_rank(), communication._torch_to_bagua_pg_map
    results = {}
    upper = dist.new_group([1, 2])  # every rank creates it, as torch requires
    if rank in (1, 2):
        results["before"] = hasattr(upper, "bagua_pg")
        results["same"] = upper.bagua_patch() is upper and upper.bagua_patch().bagua_pg is pg_map[upper]
        results["ranks"] = upper.bagua_pg.ranks
        results["upper_sum"] = _sum_over(upper.bagua_get_global_communicator(), rank)
    world = dist.group.WORLD.bagua_patch()
    results["world_sum"] = _sum_over(world.bagua_pg.get_global_communicator(), rank)
    results["patched"] = len(pg_map)
    if rank in (1, 2):
        dist.destroy_process_group(upper)
    results["after_one"] = len(pg_map), world in pg_map
    dist.destroy_process_group()
    results["after_all"] = len(pg_map)
    _save(results, rank, out_dir)


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2], *sys.argv[3:])
