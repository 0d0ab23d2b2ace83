"""The training loops people write, with bagua and with PyTorch DDP side by
side (run by test_loops.py): activation checkpointing, a forward run twice
before one backward, a parameter used twice, frozen layers,
zero_grad(set_to_none=True); and BatchNorm buffers (broadcast_buffers).

Usage: loops_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam
from bagua.torch_api.data_parallel import DistributedDataParallel as BaguaDDP


class Blocks(torch.nn.Module):
    """Four blocks; what the loop does with them is chosen by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.inp = torch.nn.Linear(12, 24)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))
        self.out = torch.nn.Linear(24, 4)
        if kind == "frozen":
            for p in list(self.inp.parameters()) + list(self.blocks[1].parameters()):
                p.requires_grad_(False)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            if self.kind.startswith("checkpoint"):
                x = checkpoint(lambda t, b=block: torch.tanh(b(t)), x,
                               use_reentrant=self.kind == "checkpoint_reentrant")
            else:
                x = torch.tanh(block(x))
            if self.kind == "param_twice" and i == 0:
                x = torch.tanh(block(x))  # the same layer once more
        return self.out(x)


class TiedTransformer(torch.nn.Module):
    """A language model whose output layer is its embedding (tied weights:
    one parameter used twice)."""

    def __init__(self, vocabulary=40, width=32):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocabulary, width)
        self.encoder = torch.nn.TransformerEncoderLayer(width, 2, dim_feedforward=64, dropout=0.0, batch_first=True)

    def forward(self, tokens):
        return self.encoder(self.embedding(tokens)) @ self.embedding.weight.t()


def run_tied(kind, wrap, rank, steps=6):
    """AdamW with clip_grad_norm_ between backward and step (and CPU bf16
    autocast for "tied_clip_bf16"): the weights after ``steps`` steps."""
    torch.manual_seed(3)
    model = TiedTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    wrapped = wrap(model, opt)
    g = torch.Generator().manual_seed(200 + rank)
    for _ in range(steps):
        tokens = torch.randint(0, 40, (4, 10), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "tied_clip_bf16"):
            logits = wrapped(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, 40), tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    engine = getattr(model, "bagua_ddp", None) or getattr(wrapped, "inner", None)
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "steps": engine.step_counter if engine is not None else None}


def data(rank, steps=6, batch=8):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, 12, generator=g), torch.randn(batch, 12, generator=g),
             torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def loop_step(kind, model, opt, x1, x2, y):
    opt.zero_grad(set_to_none=kind == "set_to_none")
    if kind == "siamese":  # two forwards, one backward
        loss = F.cross_entropy(model(x1), y) + F.mse_loss(model(x1), model(x2))
    else:
        loss = F.cross_entropy(model(x1), y)
    loss.backward()
    opt.step()


def run(kind, wrap, rank):
    """Six steps of ``kind`` with the module wrapped by ``wrap``; the
    weights after them, or the error that stopped it."""
    if kind.startswith("tied_clip"):
        return run_tied(kind, wrap, rank)
    torch.manual_seed(3)
    model = Blocks(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    try:
        wrapped = wrap(model, opt)
        for x1, x2, y in data(rank):
            loop_step(kind, wrapped, opt, x1, x2, y)
    except Exception as error:  # noqa: BLE001 - the test compares refusals
        return {"error": f"{type(error).__name__}: {error}"}
    engine = getattr(model, "bagua_ddp", None) or getattr(wrapped, "inner", None)  # None for torch's DDP
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "steps": engine.step_counter if engine is not None else None}


def scenario_loops(out_dir, kinds):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for kind in kinds.split(","):
        results[f"{kind}/ddp"] = run(kind, lambda m, o: torch.nn.parallel.DistributedDataParallel(m), rank)
        results[f"{kind}/with_bagua"] = run(
            kind, lambda m, o: m.with_bagua([o], Algorithm.init("gradient_allreduce")), rank)
        results[f"{kind}/bagua_ddp"] = run(kind, lambda m, o: BaguaDDP(m, optimizers=[o]), rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def bn_algorithm(name, model):
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
        return opt, Algorithm.init("qadam", q_adam_optimizer=opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kwargs = {"powersgd": dict(start_iter=3), "partial_allreduce": dict(group_size=2, group_generator="static"),
              "async": dict(sync_interval_ms=10)}.get(name, {})
    return opt, Algorithm.init(name, **kwargs)


def train_bn(name, rank, broadcast_buffers, steps=8):
    """``steps`` steps of a conv + BatchNorm model on this rank's batches,
    then an evaluation forward; ``name`` "ddp" is PyTorch's DDP."""
    torch.manual_seed(5)
    model = ConvBN()
    g = torch.Generator().manual_seed(500 + rank)
    batches = [(torch.randn(6, 3, 5, 5, generator=g) * (1 + rank), torch.randint(0, 5, (6,), generator=g))
               for _ in range(steps)]
    if name == "ddp":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    elif name == "bagua_ddp":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        wrapped = BaguaDDP(model, optimizers=[opt], broadcast_buffers=broadcast_buffers)
    else:
        opt, algorithm = bn_algorithm(name, model)
        wrapped = model.with_bagua([opt], algorithm, broadcast_buffers=broadcast_buffers)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
    if name == "async":
        algorithm.abort(model)
    wrapped.eval()
    with torch.no_grad():
        evaluation = wrapped(torch.ones(2, 3, 5, 5))
    result = {"weights": [p.detach().clone() for p in model.parameters()],
              "buffers": [b.detach().clone() for b in model.buffers()], "eval": evaluation}
    if name not in ("ddp", "bagua_ddp"):
        model.without_bagua()
    return result


def scenario_buffers(out_dir, names):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for broadcast in (True, False):
        for name in names.split(","):
            results[f"{name}/{broadcast}"] = train_bn(name, rank, broadcast)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
