"""Worker of test_moe.py: MoE across 2 ranks. Usage: moe_workers.py
forward OUT_DIR; each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.moe import MoE


def scenario_forward(out_dir):
    """Forward of this rank's tokens through experts spread over the ranks,
    then one training step under with_bagua."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(0)  # the same gate on every rank
    moe = MoE(6, torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6)),
              num_local_experts=2, k=1, capacity_factor=8.0)
    torch.manual_seed(10 + rank)  # this rank's own experts
    for p in moe.deepspeed_moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    tokens = torch.randn(12, 6, generator=torch.Generator().manual_seed(100 + rank))
    output, l_aux, counts = moe(tokens)
    experts = [{k: v.clone() for k, v in e.state_dict().items()} for e in moe.deepspeed_moe.experts.deepspeed_experts]
    gate = moe.deepspeed_moe.gate.wg.weight.detach().clone()
    (output.sum() + l_aux).backward()
    gate_grad = moe.deepspeed_moe.gate.wg.weight.grad.clone()
    # one step under with_bagua: the gate is averaged, the experts are not
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    wrapped = moe.with_bagua([opt], GradientAllReduceAlgorithm())
    opt.zero_grad()
    out, aux, _ = wrapped(tokens)
    (out.pow(2).sum() + aux).backward()
    opt.step()
    communicated = [name for name, _ in wrapped.bagua_ddp.bagua_build_params()]
    torch.save({"communicated": communicated, "tokens": tokens, "output": output.detach(), "experts": experts, "gate": gate,
                "gate_grad": gate_grad, "counts": counts,
                "gate_after": moe.deepspeed_moe.gate.wg.weight.detach().clone(),
                "expert_after": next(moe.deepspeed_moe.experts.parameters()).detach().clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2], *sys.argv[3:])
