"""Parameters in another memory order (run by test_layouts.py): a conv net
in channels_last, trained with bagua beside DDP; and a parameter that is a
strided view, which must be refused with its name.

Usage: layout_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).mean(dim=(2, 3)))


def train(name, rank, steps=5):
    model = ConvNet().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        kwargs = {"powersgd": dict(start_iter=2, min_compression_rate=1.0), "auto": dict(decide_after=2),
                  "partial_allreduce": dict(group_size=2, group_generator="static"),
                  "async": dict(sync_interval_ms=5)}.get(name, {})
        wrapped = model.with_bagua([opt], Algorithm.init(name, **kwargs))
    g = torch.Generator().manual_seed(60 + rank)
    for _ in range(steps):
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
    layouts = [p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4]
    grads = [p.grad.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4]
    result = {"weights": [p.detach().clone() for p in model.parameters()], "layouts": layouts, "grads": grads}
    if name == "async":
        wrapped.bagua_algorithm.abort(wrapped)
    if name != "ddp":
        model.without_bagua()
    return result


def scenario_channels_last(out_dir, names):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {name: train(name, rank) for name in ["ddp"] + names.split(",")}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_strided(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(torch.randn(4, 8)[:, ::2])  # every other column of a bigger tensor
    error = None
    try:
        # Decentralized communicates the weights themselves (a gradient
        # would be a tensor of its own, dense).
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], Algorithm.init("decentralized"))
    except bagua.InvalidArgumentError as caught:
        error = str(caught)
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))


class Recommender(torch.nn.Module):
    """A sparse EmbeddingBag table and a sparse Embedding, then an MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.table = torch.nn.EmbeddingBag(200, 8, mode="sum", sparse=True)
        self.tags = torch.nn.Embedding(30, 8, sparse=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, items, offsets, tags, use_tags=True):
        tagged = self.tags(tags) if use_tags else torch.zeros(len(offsets), 8)
        return self.mlp(torch.cat([self.table(items, offsets), tagged], dim=1))


def train_sparse(name, rank, steps=5, skip_tags=False):
    """``skip_tags``: rank 1 leaves the tags out of its third step, so it
    sends no rows for them there (DDP cannot: its Gloo sparse allreduce
    then pairs a dense zero gradient with the others' sparse ones)."""
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # sparse gradients: plain SGD, as with DDP
    if name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = model.with_bagua([opt], Algorithm.init(name), check_replicas_every=1)
    g = torch.Generator().manual_seed(80 + rank)
    rows = []
    for step in range(steps):
        items = torch.randint(0, 200, (24,), generator=g)
        offsets = torch.arange(0, 24, 3)
        tags = torch.randint(0, 30, (8,), generator=g)
        opt.zero_grad()
        out = wrapped(items, offsets, tags, use_tags=not (skip_tags and rank == 1 and step == 2))
        F.mse_loss(out, torch.randn(8, 1, generator=g)).backward()
        assert model.table.weight.grad.is_sparse
        opt.step()
        if name != "ddp":
            rows.append(model.bagua_ddp.sparse_gradients.last_rows)
    result = {"weights": [p.detach().clone() for p in model.parameters()], "rows": rows}
    if name != "ddp":
        model.without_bagua()
    return result


def scenario_sparse(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {name: train_sparse(name, rank) for name in ("ddp", "gradient_allreduce")}
    results["skip_tags"] = train_sparse("gradient_allreduce", rank, skip_tags=True)
    # ByteGrad and floatgrad compress the buckets; the sparse rows go exact.
    results["bytegrad"] = train_sparse("bytegrad", rank)
    results["floatgrad"] = train_sparse("floatgrad", rank)
    for name in ("qadam", "decentralized", "powersgd", "auto", "async", "partial_allreduce"):
        try:
            model = Recommender()
            if name == "qadam":
                from bagua.torch_api.algorithms import q_adam
                opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.01)
                model.with_bagua([opt], Algorithm.init(name, q_adam_optimizer=opt))
            else:
                kwargs = {"partial_allreduce": dict(group_size=2)}.get(name, {})
                model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], Algorithm.init(name, **kwargs))
            results[name] = None
        except bagua.InvalidArgumentError as caught:
            results[name] = str(caught)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
