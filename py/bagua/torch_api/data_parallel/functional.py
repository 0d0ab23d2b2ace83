"""Bagua's ``bagua.torch_api.data_parallel.functional``: collectives autograd
differentiates through.

``all_reduce(tensor, op, group)`` returns the reduction over the ranks of
``group`` as a new tensor; its backward all-reduces the incoming gradient
with the same op (for SUM, the exact gradient of a sum over ranks). It is
the building block of :class:`bagua.torch_api.contrib.SyncBatchNorm`.
"""

import weakref

import torch
import torch.distributed as dist
from torch.autograd import Function

from bagua.torch_api.communication import ReduceOp, allreduce_inplace
from bagua.torch_api.process_group import BaguaProcessGroup, _get_default_group

__all__ = ["ReduceOp", "torch_reduce_op_to_bagua", "all_reduce"]


def torch_reduce_op_to_bagua(op) -> ReduceOp:
    """The bagua op of ``torch.distributed.ReduceOp.SUM`` or ``MAX`` (the two
    ops :func:`all_reduce` differentiates); a bagua ReduceOp is returned as is."""
    if isinstance(op, ReduceOp):
        return op
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.MAX:
        return ReduceOp.MAX
    raise ValueError(f"Unexpect input={op}: all_reduce supports torch.distributed.ReduceOp.SUM and MAX")


# A torch group converted once (from_torch_group is collective), then reused.
_converted = weakref.WeakKeyDictionary()


def _bagua_group(group) -> BaguaProcessGroup:
    """The bagua group of ``group``: None or torch's WORLD is the default
    group; a torch group is converted with :func:`from_torch_group` on first
    use (collective: every rank must make that first call); a bagua group is
    taken as is."""
    if group is None or group is dist.GroupMember.WORLD:
        return _get_default_group()
    if isinstance(group, BaguaProcessGroup):
        return group
    if group not in _converted:
        from bagua.torch_api.communication import from_torch_group

        _converted[group] = from_torch_group(group)
    return _converted[group]


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks of ``group`` (default: all),
    as a new tensor, bitwise identical on every rank; differentiable.

    Args:
        tensor: input of the collective (not modified).
        op: ``torch.distributed.ReduceOp.SUM`` (default) or ``MAX``, or a
            bagua :class:`ReduceOp`.
        group: a ``torch.distributed`` process group, a bagua process group,
            or None for all ranks.
    """
    return _AllReduce.apply(torch_reduce_op_to_bagua(op), _bagua_group(group), tensor)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op, group, tensor):
        ctx.op, ctx.group = op, group
        result = tensor.detach().clone(memory_format=torch.contiguous_format)
        allreduce_inplace(result, op, comm=group)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output.contiguous())
