"""Helpers Bagua's users import from ``bagua.torch_api.utils``: flattening
tensors into one buffer and back, applying a call to a flattened bucket,
Bagua's dtype and reduce-op names, and the statistics its autotuner used.

Nothing here communicates by itself or needs a GPU.
"""

import logging
import math
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "flatten", "unflatten", "apply_flattened_call", "apply_flattened_call_all", "align_size",
    "check_contiguous", "get_flattened_tensor", "flatten_module_params", "collocate_params",
    "new_param", "to_bagua_datatype", "to_bagua_reduce_op", "average_by_removing_extreme_values",
    "StatisticalAverage",
]

LOGGER = logging.getLogger(__name__)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after the other (they must
    share dtype and device)."""
    return torch._utils._flatten_dense_tensors(list(tensors))


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors``, in order (the inverse of
    :func:`flatten`)."""
    return torch._utils._unflatten_dense_tensors(flat, list(tensors))


def apply_flattened_call(bucket: Sequence[torch.Tensor], call: Callable, extra_args=None) -> None:
    """Runs ``call(flat, *extra_args)`` on the flattened ``bucket`` and copies
    the result back into each tensor. ``torch.distributed.all_reduce`` is
    turned into an average (divided by the world size), as Bagua does."""
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(flat, bucket)):
        tensor.copy_(synced)


def _group_by_tensor_type(tensors) -> "OrderedDict[str, List[torch.Tensor]]":
    groups: "OrderedDict[str, List[torch.Tensor]]" = OrderedDict()
    for tensor in tensors:
        groups.setdefault(tensor.type(), []).append(tensor)
    return groups


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable) -> None:
    """:func:`apply_flattened_call` once per tensor type (dtype and device) in
    ``tensors``, in order of first appearance."""
    for group in _group_by_tensor_type(tensors).values():
        apply_flattened_call(group, call)


def align_size(size: int, align: int) -> int:
    """``size`` rounded up to a multiple of ``align``."""
    return -(-int(size) // int(align)) * int(align)


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each tensor starts in memory exactly where the previous one ends."""
    end = None
    for tensor in tensors:
        if end is not None and tensor.data_ptr() != end:
            return False
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return True


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A new 1-D tensor (dtype and device of the first) with the tensors' data
    one after the other; None for no tensors."""
    if len(tensors) == 0:
        return None
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()] = tensor.reshape(-1)
        offset += tensor.numel()
    return flat


def new_param(weight: torch.Tensor, grad: torch.Tensor) -> torch.nn.Parameter:
    """A parameter (not requiring grad) over ``weight`` with ``grad`` as its gradient."""
    with torch.no_grad():
        param = torch.nn.Parameter(weight, requires_grad=False)
        param.grad = grad
        return param


def _aligned_sizes(params: Sequence[torch.Tensor], align_bytes: int) -> int:
    """Sets ``p.allocated_size`` (elements, the last one padded so the total
    is a multiple of ``align_bytes``) and returns the padded total."""
    element = params[0].element_size()
    if align_bytes != 1 and align_bytes % element != 0:
        raise ValueError(f"align_bytes ({align_bytes}) must be a multiple of the element size ({element})")
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    aligned = align_size(total * element, align_bytes) // element
    sizes[-1] += aligned - total
    for p, size in zip(params, sizes):
        p.allocated_size = size
    return aligned


def flatten_module_params(params_list, align_bytes: int) -> Optional[torch.nn.Parameter]:
    """Moves the parameters (a list, or a list of lists) and their gradients
    into two flat buffers, each list padded to ``align_bytes``; every
    parameter becomes a view of the weight buffer and its ``.grad`` a view of
    the gradient buffer at the same offset. Returns a parameter over the two
    buffers (see :func:`new_param`)."""
    if len(params_list) == 0:
        return None
    if not isinstance(params_list[0], (list, tuple)):
        params_list = [params_list]
    total = sum(_aligned_sizes(params, align_bytes) for params in params_list)
    first = params_list[0][0]
    weights = torch.zeros(total, dtype=first.dtype, device=first.device)
    grads = torch.zeros(total, dtype=first.dtype, device=first.device)
    offset = 0
    with torch.no_grad():
        for params in params_list:
            for p in params:
                n = p.numel()
                weights[offset:offset + n] = p.data.reshape(-1)
                if p.grad is not None:
                    grads[offset:offset + n] = p.grad.data.reshape(-1)
                p.data = weights[offset:offset + n].view_as(p.data)
                p.grad = grads[offset:offset + n].view_as(p.data)
                offset += p.allocated_size
    for params in params_list:
        assert check_contiguous([p.data for p in params]) and check_contiguous([p.grad.data for p in params])
    return new_param(weights, grads)


def collocate_params(params: Sequence[torch.nn.Parameter]) -> torch.nn.Parameter:
    """One parameter spanning ``params``, which must lie back to back in one
    weight storage with their gradients at the same offsets of one gradient
    storage (as :func:`flatten_module_params` leaves them)."""
    if len(params) == 1:
        return params[0]
    ordered = sorted(params, key=lambda p: p.data.storage_offset())
    start = end = None
    for p in ordered:
        if p.data.storage_offset() != p.grad.data.storage_offset():
            raise ValueError("collocated weights and gradients must have the same storage offsets")
        if start is None:
            start = end = p.data.storage_offset()
        elif end != p.data.storage_offset():
            raise ValueError("collocated parameters must be contiguous")
        bagua_tensor = getattr(p, "bagua_tensor", None)
        end += bagua_tensor.num_elem_allocated() if bagua_tensor is not None else p.numel()
    first = params[0]
    with torch.no_grad():
        weight = first.data.new_empty(0).set_(_storage(first.data), start, (end - start,))
        grad = first.grad.data.new_empty(0).set_(_storage(first.grad.data), start, (end - start,))
        return new_param(weight, grad)


def _storage(tensor: torch.Tensor):
    return tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()


_BAGUA_DATATYPES: Dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64",
}


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's name of a dtype: "f32", "f16", "u8" or "i64"."""
    try:
        return _BAGUA_DATATYPES[datatype]
    except KeyError:
        raise ValueError(f"unsupported data type {datatype}.") from None


def to_bagua_reduce_op(torch_reduce_op) -> int:
    """The value of :class:`bagua.torch_api.ReduceOp` for a
    ``torch.distributed.ReduceOp``."""
    from bagua.torch_api._primitives import ReduceOp

    names = ("SUM", "PRODUCT", "MIN", "MAX", "BOR", "BAND", "BXOR")
    for name in names:
        if torch_reduce_op == getattr(dist.ReduceOp, name):
            return int(ReduceOp[name])
    raise ValueError(f"unsupported reduce op {torch_reduce_op}.")


def average_by_removing_extreme_values(raw_score_list):
    """(mean, std, kept values) of a series of measurements, after dropping
    its first third (warm-up) and then values more than one standard
    deviation from the mean, repeatedly (at most 11 passes) while the
    standard deviation is not below the mean."""
    scores = np.asarray(raw_score_list)
    scores = scores[len(scores) // 3:]

    def within_one_std(values):
        kept = values[np.abs(values - np.mean(values)) < np.std(values)]
        return kept if len(kept) else values

    scores = within_one_std(scores)
    for _ in range(10):
        if np.std(scores) < np.mean(scores):
            break
        scores = within_one_std(scores)
    return np.mean(scores), np.std(scores), scores.tolist()


class StatisticalAverage:
    """Averages of a measured value over the last 1, 2, 4, ... seconds.

    ``records[i]`` is the mean over the 2**i seconds before
    ``last_update_time``; ``record_tail`` is ``(seconds, mean)`` of what was
    recorded before the span ``records`` covers.
    """

    def __init__(self, last_update_time: Optional[float] = None, records: Optional[List[float]] = None,
                 record_tail: Tuple[float, float] = (0.0, 0.0)) -> None:
        self.last_update_time: float = time.time() if last_update_time is None else last_update_time
        self.records: List[float] = list(records) if records is not None else []
        self.record_tail: Tuple[float, float] = tuple(record_tail)

    def record_seconds(self) -> float:
        """The span ``records`` covers."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """The mean over the ``last_n_seconds`` before ``last_update_time``,
        interpolated linearly between the spans recorded."""
        if last_n_seconds <= 0.0:
            return 0.0
        tail_seconds, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        if last_n_seconds < 1.0:
            return self.records[0]
        covered = self.record_seconds()
        if last_n_seconds <= covered:
            i = max(0, math.floor(math.log(last_n_seconds, 2.0)))
            if i + 1 >= len(self.records):
                return self.records[i]
            low = 2.0 ** i
            return _interpolate(self.records[i], self.records[i + 1], low, 2.0 * low, last_n_seconds)
        if last_n_seconds <= covered + tail_seconds:
            return _interpolate(self.records[-1], tail_mean, covered, covered + tail_seconds, last_n_seconds)
        return tail_mean

    def record(self, val: float) -> None:
        """Records ``val`` as the value measured since the last update."""
        now = time.time()
        elapsed = now - self.last_update_time
        recorded = self.total_recording_time()
        records: List[float] = []
        tail: Tuple[float, float] = (0.0, 0.0)
        for i in range(64):
            span = 2.0 ** i
            if span <= elapsed:
                records.append(val)
            elif span <= elapsed + recorded:
                share = elapsed / span
                records.append(val * share + self.get_records_mean(span - elapsed) * (1.0 - share))
            else:
                total = elapsed + recorded
                share = elapsed / total
                tail = (total - 2.0 ** (len(records) - 1),
                        val * share + self.get_records_mean(recorded) * (1.0 - share))
                break
        self.last_update_time = now
        self.records = records
        self.record_tail = tail

    def get(self, last_n_seconds: float) -> float:
        """The mean over the last ``last_n_seconds`` before now."""
        elapsed = time.time() - self.last_update_time
        if last_n_seconds <= elapsed:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - elapsed)

    def __str__(self) -> str:
        return str({"last_update_time": self.last_update_time, "records": self.records,
                    "record_tail": self.record_tail})


def _interpolate(a: float, b: float, a_at: float, b_at: float, at: float) -> float:
    return a + (b - a) * (at - a_at) / (b_at - a_at)
