"""Bagua's mixture-of-experts layer, ``bagua.torch_api.moe.MoE``."""

import logging
from typing import Optional

import torch

from bagua.torch_api.moe.experts import Experts
from bagua.torch_api.moe.sharded_moe import MOELayer, TopKGate

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """A mixture-of-experts layer with ``num_local_experts`` experts on each
    rank (``num_local_experts * world_size`` in all), tokens sent to their
    experts' ranks by alltoall.

    Args:
        hidden_size: the model dimension (input and output).
        expert: the module every expert copies (e.g. an MLP).
        num_local_experts: experts on this rank.
        k: 1 or 2, the experts each token goes to.
        output_dropout_prob: dropout on the output.
        capacity_factor, eval_capacity_factor: an expert's buffer holds
            ``factor * tokens / experts`` tokens (times k) in training and
            evaluation; tokens beyond it are dropped (output 0).
        min_capacity: the least buffer size.
        noisy_gate_policy: None, ``"Jitter"`` (input noise) or ``"RSample"``
            (Gumbel noise on the top-1 choice).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux,
    exp_counts)``: add ``l_aux`` (the load-balancing loss) to the loss. The
    experts' parameters carry ``allreduce = False``: each rank trains its
    own experts; the gate is shared.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_local_experts: int = 1, k: int = 1,
                 output_dropout_prob: float = 0.0, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: Optional[str] = None):
        super().__init__()
        import bagua.torch_api as bagua
        world = bagua.get_world_size() if bagua.is_initialized() else 1
        self.num_experts = num_local_experts * world
        logging.getLogger(__name__).info("num_experts: %d | num_local_experts: %d | world_size: %d",
                                         self.num_experts, num_local_experts, world)
        self.deepspeed_moe = MOELayer(
            TopKGate(hidden_size, self.num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                     noisy_gate_policy),
            Experts(expert, num_local_experts), num_local_experts)
        self.dropout = torch.nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.dropout(self.deepspeed_moe(hidden_states, used_token))
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
