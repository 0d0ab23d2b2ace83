"""bagua's DDP communication hooks (run by test_ddp_hooks.py): PyTorch's
DistributedDataParallel with bytegrad_hook against with_bagua's ByteGrad on
the same model, batches and bucket; and the digits MLP's accuracy with the
hook against plain DDP.

Usage: hook_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api import ddp_hooks
from bagua.torch_api.algorithms import bytegrad

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits_mlp import MLP, load_data  # noqa: E402


def mlp():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 5))


def train(wrapped, opt, rank, steps=5):
    g = torch.Generator().manual_seed(90 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()


def warm_up(wrapped, rank):
    """One forward and backward, no step: the gradients are dropped."""
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(7 + rank))
    wrapped(x).sum().backward()
    for p in wrapped.parameters():
        p.grad = None


def scenario_equal(out_dir):
    """One bucket each, laid out alike. DDP's first backward lays its bucket
    out in module order and then rebuilds it in the order gradients became
    ready, which is bagua's order from the start: the first backward of both
    is left out (no optimizer step), and the layouts are recorded, so a
    difference shows."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    hooked = mlp()
    names = {p.data_ptr(): n for n, p in hooked.named_parameters()}
    opt = torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(hooked, bucket_cap_mb=100)
    ddp_layouts = []

    def recording_hook(state, bucket):
        ddp_layouts.append([names[p.data_ptr()] for p in bucket.parameters()])
        return ddp_hooks.bytegrad_hook(state, bucket)

    recording_hook.__annotations__ = ddp_hooks.bytegrad_hook.__annotations__
    ddp.register_comm_hook(ddp_hooks.ByteGradState(), recording_hook)
    warm_up(ddp, rank)
    train(ddp, opt, rank)
    ours = mlp()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ours.with_bagua([opt], bytegrad.ByteGradAlgorithm(hierarchical=False))
    warm_up(ours, rank)
    train(ours, opt, rank)
    layout = [t.bagua_tensor_name for t in ours.bagua_ddp.bagua_buckets[0].tensors]
    torch.save({"hook": [p.detach().clone() for p in hooked.parameters()],
                "bagua": [p.detach().clone() for p in ours.parameters()],
                "buckets": len(ours.bagua_ddp.bagua_buckets), "layout": layout, "ddp_layouts": ddp_layouts[1:]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_digits(out_dir, epochs="12"):
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    x_train, y_train, x_test, y_test = load_data(0)
    shard = slice(rank, None, world)
    x, y = x_train[shard], y_train[shard]
    results = {}
    for kind in ("ddp", "bytegrad_hook"):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if kind == "bytegrad_hook":
            ddp.register_comm_hook(ddp_hooks.ByteGradState(), ddp_hooks.bytegrad_hook)
        g = torch.Generator().manual_seed(rank)
        for _ in range(int(epochs)):
            order = torch.randperm(len(x), generator=g)
            for i in range(0, len(x) - 31, 32):
                batch = order[i:i + 32]
                opt.zero_grad()
                F.cross_entropy(ddp(x[batch]), y[batch]).backward()
                opt.step()
        with torch.no_grad():
            results[kind] = (model(x_test).argmax(1) == y_test).float().mean().item()
        results[f"{kind}/weights"] = [p.detach().clone() for p in model.parameters()]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
