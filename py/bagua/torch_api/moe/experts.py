"""The local experts of a mixture-of-experts layer: copies of one module."""

import copy

import torch

__all__ = ["Experts"]


class Experts(torch.nn.Module):
    """``num_local_experts`` independent copies of ``expert``. Input
    (groups, num_local_experts, capacity, model): expert i processes
    ``input[:, i]``."""

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:  # not averaged across ranks: each rank owns its experts
            for p in e.parameters():
                p.allreduce = False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([expert(chunk) for chunk, expert in zip(chunks, self.deepspeed_experts)], dim=1)
