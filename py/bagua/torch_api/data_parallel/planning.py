"""Bucket planning: which tensors are communicated together, in which order.

At wrap time the tensors come in the algorithm's order (for gradients,
reverse parameter order: the usual ready order). After the first iteration
the runtime knows the order in which they actually became ready; rank 0's
profiled order is broadcast and every rank re-plans with it. The C++ planner
cuts the ordered tensors into buckets of about ``bucket_bytes``; a digest of
the resulting layout is compared across ranks, because ranks that bucket
differently would issue different collectives and hang.
"""

import zlib
from typing import Dict, List, Optional, Sequence

import torch

from bagua.torch_api._core import InvalidArgumentError, core, device_name, dtype_name
from bagua.torch_api.communication import allgather, broadcast
from bagua.torch_api.tensor import BaguaTensor


def index_by_name(tensors: Sequence[BaguaTensor], owner: str) -> Dict[str, BaguaTensor]:
    """name -> tensor; names must be unique (they name the tensors to the backend)."""
    by_name = {t.bagua_tensor_name: t for t in tensors}
    if len(by_name) != len(tensors):
        raise InvalidArgumentError(f"{owner}.init_tensors returned duplicate names")
    return by_name


def in_order(tensors: Sequence[BaguaTensor], order: Optional[List[str]]) -> List[BaguaTensor]:
    """``tensors`` in ``order`` (names) when it names exactly these tensors;
    otherwise as they are (e.g. an algorithm that changed its tensors)."""
    by_name = {t.bagua_tensor_name: t for t in tensors}
    if order is not None and sorted(order) == sorted(by_name):
        return [by_name[name] for name in order]
    return list(tensors)


def plan_buckets(impl, ordered: Sequence[BaguaTensor], bucket_bytes: int, do_flatten: bool) -> list:
    """The planner's grouping of ``ordered`` into buckets of about
    ``bucket_bytes`` (tensors of one dtype and device per bucket), made into
    buckets by the algorithm's ``tensors_to_buckets``."""
    currents = [t._bagua_current() for t in ordered]
    declarations = [(t.bagua_tensor_name, c.numel(), dtype_name(c.dtype), device_name(c.device))
                    for t, c in zip(ordered, currents)]
    plan = core.plan_buckets(declarations, bucket_bytes)
    return impl.tensors_to_buckets([[ordered[i] for i in bucket] for bucket in plan], do_flatten)


def bucket_order(buckets) -> List[str]:
    """The names of the bucketed tensors, in bucket order."""
    return [t.bagua_tensor_name for b in buckets for t in b.tensors]


def bucket_layout(bucket) -> str:
    """The bucket's name, tensors and sizes, as a string to compare."""
    return f"{bucket.name}:" + ",".join(f"{t.bagua_tensor_name}/{t.bagua_registered_tensor().numel()}"
                                        for t in bucket.tensors)


def verify_same_buckets(buckets, group) -> None:
    """Every rank must register the same buckets: compare a digest (bucket
    count and a CRC of names and sizes) with one allgather."""
    layout = ";".join(bucket_layout(b) for b in buckets)
    digest = torch.tensor([len(buckets), zlib.crc32(layout.encode())], dtype=torch.int64)
    comm = group.get_global_communicator()
    if comm.size == 1:
        return
    gathered = torch.zeros(2 * comm.size, dtype=torch.int64)
    allgather(digest, gathered, comm=group)
    rows = gathered.view(comm.size, 2).tolist()
    if any(row != rows[0] for row in rows):
        raise InvalidArgumentError(
            f"rank {comm.rank}: ranks built different buckets (per rank [count, digest]: {rows}); "
            "every rank must wrap the same model with the same algorithm")


def profiled_order(ready_order: List[str], tensors: Sequence[BaguaTensor], buckets,
                   group) -> Optional[List[str]]:
    """Rank 0's ready order (``ready_order`` as the backend recorded it),
    when it differs from the buckets' current order; None otherwise.
    Collective when the profile is complete (a broadcast from rank 0)."""
    names = [t.bagua_tensor_name for t in tensors]
    if sorted(ready_order) != sorted(names):
        return None  # not a full profile (e.g. weights marked by the algorithm)
    index = {name: i for i, name in enumerate(names)}
    positions = torch.tensor([index[n] for n in ready_order], dtype=torch.int64)
    broadcast(positions, 0, comm=group)
    rank0_order = [names[i] for i in positions.tolist()]
    return rank0_order if rank0_order != bucket_order(buckets) else None
