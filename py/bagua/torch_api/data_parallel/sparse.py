"""Sparse gradients: ``nn.Embedding(..., sparse=True)`` and
``nn.EmbeddingBag(..., sparse=True)``, as DDP reduces them.

A recommendation model's table may hold millions of rows while a step
touches a few hundred: its gradient is a sparse tensor (row indices and
their values), and communicating the dense table would cost the whole table
every step. These parameters stay out of the buckets. After backward (once
the buckets' ops are done) each one is exchanged on the training thread:
one allgather of the ranks' row counts, then one of the indices and one of
the values (each rank's padded to the largest count), summed into a
coalesced sparse gradient and, with ``average``, divided by the world size.
Every rank exchanges every sparse parameter every step, in module order
(a rank that did not use the table sends no rows), so the calls match.

Only algorithms that average gradients exactly can take them
(``AlgorithmImpl.reduces_sparse_gradients``: GradientAllReduce); the others
refuse such a model at ``with_bagua``, naming the parameter.
"""

from typing import List, Tuple

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.communication import allgather

__all__ = ["sparse_gradient_parameters", "SparseGradients"]


def sparse_gradient_parameters(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the embeddings that produce sparse gradients."""
    sparse_ids = {id(m.weight) for m in module.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    seen, named = set(), []
    for name, param in module.named_parameters():
        if id(param) in sparse_ids and param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return named


class SparseGradients:
    """Reduces one engine's sparse gradients over its group."""

    def __init__(self, named: List[Tuple[str, torch.nn.Parameter]], group, average: bool):
        self.named = named
        self.group = group
        self.average = average
        #: rows and bytes this rank sent in the last reduction (for benchmarks)
        self.last_rows, self.last_bytes_sent = 0, 0

    def reduce(self) -> None:
        """Collective: every rank calls it once per step."""
        self.last_rows, self.last_bytes_sent = 0, 0
        for name, param in self.named:
            self._reduce_one(name, param)

    def _reduce_one(self, name: str, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is not None and not grad.is_sparse:
            raise InvalidArgumentError(
                f"parameter '{name}' belongs to a sparse embedding but got a dense gradient; "
                "bagua communicates it as sparse on every rank")
        width = param.shape[1:].numel()
        if grad is None:
            indices = torch.zeros(0, dtype=torch.int64, device=param.device)
            values = torch.zeros(0, width, dtype=param.dtype, device=param.device)
        else:
            grad = grad.coalesce()
            indices = grad.indices()[0].contiguous()
            values = grad.values().reshape(-1, width).contiguous()
        size = self.group.get_size()
        counts = self._gather(torch.tensor([indices.numel()], dtype=torch.int64, device=param.device)).tolist()
        most = max(counts)
        if most == 0:
            return  # nobody used the table this step: no gradient, as with DDP
        padded_indices = torch.zeros(most, dtype=torch.int64, device=param.device)
        padded_indices[:indices.numel()] = indices
        padded_values = torch.zeros(most, width, dtype=param.dtype, device=param.device)
        padded_values[:values.shape[0]] = values
        all_indices = self._gather(padded_indices).view(size, most)
        all_values = self._gather(padded_values.reshape(-1)).view(size, most, width)
        self.last_rows += indices.numel()
        self.last_bytes_sent += most * (8 + width * param.element_size())
        rows = torch.cat([all_indices[r, :counts[r]] for r in range(size)])
        row_values = torch.cat([all_values[r, :counts[r]] for r in range(size)])
        summed = torch.sparse_coo_tensor(rows.unsqueeze(0), row_values.view(-1, *param.shape[1:]),
                                         param.shape).coalesce()
        if self.average:
            summed = summed / size
        param.grad = summed

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        size = self.group.get_size()
        if size == 1:
            return tensor
        out = torch.zeros(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        allgather(tensor, out, comm=self.group)
        return out

    def drop_local(self) -> None:
        """A joined rank's shadow step: it sends no rows."""
        for _, param in self.named:
            param.grad = None

    def scale(self, factor: float) -> None:
        with torch.no_grad():
            for _, param in self.named:
                if param.grad is not None:
                    param.grad = param.grad * factor
