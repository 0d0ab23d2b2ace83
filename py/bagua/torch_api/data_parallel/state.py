"""Every rank starts from rank 0's state: parameters, buffers and optimizer
state are broadcast when a module is wrapped, so ranks that initialized
their models differently (another seed, a checkpoint on rank 0 only) train
the same model from the first step."""

from typing import Iterable, List

import torch

from bagua.torch_api.communication import broadcast


def module_and_optimizer_state(module: torch.nn.Module, optimizers) -> List[torch.Tensor]:
    """The tensors that make up the training state, in the same order on every
    rank: parameters, buffers, then each optimizer's tensor state (keys
    sorted, so dict order cannot differ between ranks)."""
    tensors = [p.data for p in module.parameters()] + [b for b in module.buffers()]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key in sorted(optimizer.state.get(p, {})):
                    value = optimizer.state[p][key]
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
    return tensors


def broadcast_coalesced(tensors: Iterable[torch.Tensor], group, src: int = 0) -> None:
    """Broadcasts tensors from ``src``, one message per dtype and device."""
    if group.get_size() == 1:
        return
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            broadcast(flat, src, comm=group)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_states(module: torch.nn.Module, optimizers, group) -> None:
    """Makes every rank's parameters, buffers and optimizer state rank 0's."""
    broadcast_coalesced(module_and_optimizer_state(module, optimizers), group)
