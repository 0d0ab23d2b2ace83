"""Worker of test_fused_optimizer.py: the fused optimizer under with_bagua.
Usage: fused_optimizer_workers.py with_bagua OUT_DIR FLATTEN; each rank
saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.contrib.fuse.optimizer import fused_parameter_counts


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)


def scenario_with_bagua(out_dir, flatten):
    """Two wrapped models trained on the same batches, one stepping with
    step() and one with fuse_step() (fused before wrapping)."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    plain, plain_opt = make()
    fused, fused_opt = make()
    fused_opt = bagua.contrib.fuse_optimizer(fused_opt)
    plain = plain.with_bagua([plain_opt], GradientAllReduceAlgorithm(), do_flatten=flatten == "1")
    fused = fused.with_bagua([fused_opt], GradientAllReduceAlgorithm(), do_flatten=flatten == "1")
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(6, 4, generator=g)
        for model, opt, fuse in ((plain, plain_opt, False), (fused, fused_opt, True)):
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).sum().backward()
            opt.fuse_step() if fuse else opt.step()
    torch.save({"plain": [p.detach().clone() for p in plain.parameters()],
                "fused": [p.detach().clone() for p in fused.parameters()],
                "counts": fused_parameter_counts(fused_opt), "fused_count": fused_opt._bagua_fused_count},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2], *sys.argv[3:])
