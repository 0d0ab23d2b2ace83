"""Every rank starts from rank 0's state: parameters, buffers and optimizer
state are broadcast when a module is wrapped, so ranks that initialized
their models differently (another seed, a checkpoint on rank 0 only) train
the same model from the first step."""

import hashlib
from typing import Iterable, List

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.communication import allgather, broadcast


def model_signature(module: torch.nn.Module) -> List[str]:
    """One line per parameter and buffer: name, dtype, shape and whether it
    trains. Ranks that wrap different models differ here."""
    lines = [f"parameter '{name}' {p.dtype}{list(p.shape)}{'' if p.requires_grad else ' frozen'}"
             for name, p in module.named_parameters()]
    return lines + [f"buffer '{name}' {b.dtype}{list(b.shape)}" for name, b in module.named_buffers()]


def _bytes_tensor(text: str, size: int) -> torch.Tensor:
    data = text.encode()[:size]
    return torch.tensor(list(data) + [0] * (size - len(data)), dtype=torch.uint8)


def _text(t: torch.Tensor) -> str:
    return bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")


def _first_difference(mine: List[str], reference: List[str]) -> str:
    for index, (a, b) in enumerate(zip(mine, reference)):
        if a != b:
            return f"entry {index} is {a}, rank 0's is {b}"
    if len(mine) != len(reference):
        return f"{len(mine)} parameters and buffers, rank 0 has {len(reference)}"
    return ""


def check_same_model(module: torch.nn.Module, group) -> None:
    """Every rank wraps the same model: the same parameters and buffers, by
    name, dtype and shape, in the same order. Otherwise every rank raises an
    InvalidArgumentError naming each differing rank's first difference from
    rank 0 (instead of a size mismatch deep in the first broadcast, or worse).
    One allgather of a hash when the models agree."""
    size = group.get_size()
    if size == 1:
        return
    lines = model_signature(module)
    digest = hashlib.sha256("\n".join(lines).encode()).digest()[:7]
    hashes = torch.zeros(size, dtype=torch.int64)
    allgather(torch.tensor([int.from_bytes(digest, "little")]), hashes, comm=group)
    if bool((hashes == hashes[0]).all()):
        return
    # Rank 0's signature, then each rank's first difference from it.
    text = "\n".join(lines).encode()
    length = torch.tensor([len(text)], dtype=torch.int64)
    broadcast(length, 0, comm=group)
    reference = torch.tensor(list(text), dtype=torch.uint8) if group.get_rank() == 0 \
        else torch.zeros(int(length.item()), dtype=torch.uint8)
    if reference.numel() > 0:
        broadcast(reference, 0, comm=group)
    difference = _first_difference(lines, _text(reference).split("\n") if reference.numel() else [])
    width = 400
    reports = torch.zeros(size * width, dtype=torch.uint8)
    allgather(_bytes_tensor(difference, width), reports, comm=group)
    details = [f"rank {r}: {_text(reports[r * width:(r + 1) * width])}" for r in range(size)
               if _text(reports[r * width:(r + 1) * width])]
    raise InvalidArgumentError(
        "with_bagua: the ranks wrapped different models (each rank must build the same model): "
        + "; ".join(details))


def check_trainable(module: torch.nn.Module) -> None:
    """A model with nothing to train has nothing to communicate (DDP refuses
    it too); its parameters can be unfrozen before with_bagua."""
    if not any(p.requires_grad for p in module.parameters()):
        raise InvalidArgumentError(
            f"with_bagua: {type(module).__name__} has no parameter that requires a gradient, so there is "
            "nothing to communicate; unfreeze the parameters to train before wrapping")


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
