"""GShard's mixture-of-experts layer (Lepikhin et al., 2020, Algorithm 2):
a gate picks the top-1 or top-2 experts of every token, each expert takes
at most ``capacity`` tokens, an alltoall sends every expert its tokens (the
experts are spread over the ranks), a second alltoall brings the results
back, and each token's output is its experts' outputs weighted by the gate.

Shapes: s tokens, e experts, c capacity, m model dimension.
- ``combine_weights`` (s, e, c): the gate weight of token s in slot c of
  expert e (0 where it is not there);
- ``dispatch_mask`` (s, e, c): where each token goes.
Tokens beyond an expert's capacity are dropped: their output is 0 (the
residual connection around the layer carries them).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from bagua.torch_api import InvalidArgumentError

__all__ = ["top1gating", "top2gating", "TopKGate", "MOELayer", "gumbel_rsample", "multiplicative_jitter"]


def gumbel_rsample(shape, device) -> torch.Tensor:
    """Gumbel(0, 1) noise: top-2 gating picks the second expert by the
    Gumbel-max trick (a sample from the softmax without the first)."""
    uniform = torch.rand(shape, device=device).clamp_(1e-20, 1.0)
    return -torch.log(-torch.log(uniform).clamp_(min=1e-20))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """x times uniform noise in [1 - epsilon, 1 + epsilon] (the Switch
    Transformer's input jitter)."""
    if epsilon == 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(min_capacity, math.ceil(tokens / experts * factor))


def _slots(mask: torch.Tensor, locations: torch.Tensor, capacity: int) -> torch.Tensor:
    """(s, c) one-hot of each token's slot in its expert's buffer."""
    return F.one_hot((locations * mask).sum(dim=1), num_classes=capacity).float()


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None):
    """Top-1 gating: (l_aux, combine_weights, dispatch_mask, exp_counts).
    Over capacity, an expert keeps a random subset of its tokens (so no
    position in the batch is favoured)."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    capacity = _capacity(tokens, experts, capacity_factor, min_capacity)
    scores = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(torch.argmax(scores, dim=1), num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach().cpu()
    # load-balancing loss: fraction of tokens times mean gate, per expert
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
    # keep at most `capacity` tokens per expert, chosen at random
    priority = mask * torch.rand(mask.shape, device=mask.device)
    kept = torch.zeros_like(mask).scatter_(0, torch.topk(priority, k=min(capacity, tokens), dim=0).indices, 1)
    mask = mask * kept
    locations = torch.cumsum(mask, dim=0) - 1
    gates = gates * mask.float()
    combine_weights = torch.einsum("se,sc->sec", gates, _slots(mask, locations, capacity))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int = 0):
    """Top-2 gating: the best expert and a second one drawn by the
    Gumbel-max trick among the others; the two gate weights renormalized to
    sum to 1; first choices take the buffer slots before second ones.
    Returns (l_aux, combine_weights, dispatch_mask, exp_counts)."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    capacity = _capacity(tokens, experts, 2 * capacity_factor, min_capacity)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=experts)
    noisy = (logits + gumbel_rsample(logits.shape, logits.device)).masked_fill(mask1.bool(), float("-inf"))
    mask2 = F.one_hot(torch.argmax(noisy, dim=1), num_classes=experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    exp_counts = mask1.sum(dim=0).detach().cpu()
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    mask1 = mask1 * (locations1 < capacity)
    mask2 = mask2 * (locations2 < capacity)
    gate1 = (gates * mask1.float()).sum(dim=1)
    gate2 = (gates * mask2.float()).sum(dim=1)
    total = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    combine_weights = (torch.einsum("s,se,sc->sec", gate1 / total, mask1.float(), _slots(mask1, locations1, capacity)) +
                       torch.einsum("s,se,sc->sec", gate2 / total, mask2.float(), _slots(mask2, locations2, capacity)))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


class TopKGate(torch.nn.Module):
    """The gate: a bias-free linear map to one logit per expert (in fp32),
    then top-1 or top-2 gating."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: Optional[str] = None):
        super().__init__()
        if k not in (1, 2):
            raise InvalidArgumentError(f"TopKGate: k must be 1 or 2, got {k!r}")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise InvalidArgumentError(f"TopKGate: noisy_gate_policy must be None, 'Jitter' or 'RSample', "
                                       f"got {noisy_gate_policy!r}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy

    def forward(self, inputs: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        x = inputs.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None)
        return top2gating(logits, factor, self.min_capacity)


class _AllToAll(torch.autograd.Function):
    """bagua.alltoall with its own transpose as the gradient."""

    @staticmethod
    def forward(ctx, comm, inputs: torch.Tensor) -> torch.Tensor:
        import bagua.torch_api as bagua
        ctx.comm = comm
        inputs = inputs.contiguous()
        if comm is None and (not bagua.is_initialized() or bagua.get_world_size() == 1):
            return inputs.clone()
        out = torch.empty_like(inputs)
        bagua.alltoall(inputs, out, comm=comm)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _AllToAll.apply(ctx.comm, grad)


class MOELayer(torch.nn.Module):
    """Gate, dispatch (alltoall), local experts, return (alltoall), combine.
    After forward, ``l_aux`` is the gate's load-balancing loss and
    ``exp_counts`` the tokens each expert was picked for."""

    def __init__(self, gate: torch.nn.Module, experts: torch.nn.Module, num_local_experts: int, group=None):
        super().__init__()
        import bagua.torch_api as bagua
        self.gate = gate
        self.experts = experts
        self.group = group
        self.world_size = bagua.get_world_size() if bagua.is_initialized() else 1
        self.num_local_experts = num_local_experts

    def forward(self, *inputs: torch.Tensor, **kwargs) -> torch.Tensor:
        x = inputs[0]
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        used_token = inputs[1] if len(inputs) > 1 else None
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), tokens)
        dispatched = _AllToAll.apply(self.group, dispatched)  # every rank gets its experts' slots
        dispatched = dispatched.reshape(self.world_size, self.num_local_experts, -1, d_model)
        expert_output = _AllToAll.apply(self.group, self.experts(dispatched))
        expert_output = expert_output.reshape(self.world_size * self.num_local_experts, -1, d_model)
        return torch.einsum("sec,ecm->sm", combine_weights.type_as(x), expert_output).reshape(x.shape)
