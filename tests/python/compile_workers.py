"""torch.compile with bagua: worker scenarios (run by test_compile.py).

Usage: compile_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam
from workers import Net, batches

SYNCHRONOUS = ["gradient_allreduce", "bytegrad", "qadam", "powersgd"]
WEIGHT_BASED = ["decentralized", "low_precision_decentralized", "partial_allreduce"]


class CompileCounter:
    """A Dynamo backend (aot_eager or inductor underneath) that counts the
    graphs it is given, so a test can see when compilation happens."""

    def __init__(self, inner: str):
        self.inner = inner
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.inner)(graph_module, example_inputs)


def make(name, model):
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=5)
        return opt, Algorithm.init("qadam", q_adam_optimizer=opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kwargs = {"powersgd": dict(start_iter=3), "partial_allreduce": dict(group_size=2, group_generator="static"),
              "async": dict(sync_interval_ms=20)}.get(name, {})
    return opt, Algorithm.init(name, **kwargs)


def train(name, compiled, order, steps, backend):
    """``steps`` steps of ``name``; ``compiled``: None (eager), or the order
    "wrap_then_compile" / "compile_then_wrap". Returns the weights and the
    steps at which Dynamo compiled something."""
    torch.manual_seed(7)
    model = Net()
    opt, algorithm = make(name, model)
    counter = CompileCounter(backend)
    torch._dynamo.reset()
    if compiled and order == "compile_then_wrap":
        model = torch.compile(model, backend=counter)
        run = model.with_bagua([opt], algorithm)
    else:
        model = model.with_bagua([opt], algorithm)
        run = torch.compile(model, backend=counter) if compiled else model
    compiling_steps = []
    for step, (x, y) in enumerate(batches(bagua.get_rank(), steps=steps)):
        before = counter.graphs
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        opt.step()
        if counter.graphs != before:
            compiling_steps.append(step)
    if name == "async":
        algorithm.abort(model, average=True)  # one last synchronous average
    weights = [p.detach().clone() for p in model.parameters()]
    model.without_bagua()
    return weights, compiling_steps


def scenario_algorithms(out_dir, order, names, steps="50", backend="aot_eager"):
    bagua.init_process_group()
    results = {}
    for name in names.split(","):
        results[f"{name}/eager"], _ = train(name, None, order, int(steps), backend)
        results[f"{name}/compiled"], results[f"{name}/compiling_steps"] = train(name, True, order, int(steps),
                                                                                 backend)
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def scenario_versus_ddp(out_dir, backend="inductor", steps="10"):
    """GradientAllReduce compiled against torch's DDP compiled, same data."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for kind in ("ddp", "bagua"):
        torch.manual_seed(7)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch._dynamo.reset()
        if kind == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            wrapped = model.with_bagua([opt], Algorithm.init("gradient_allreduce"))
        run = torch.compile(wrapped, backend=backend)
        for x, y in batches(rank, steps=int(steps)):
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
        results[kind] = [p.detach().clone() for p in model.parameters()]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


class Deep(torch.nn.Module):
    def __init__(self, width=768, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum(dim=1)


def scenario_ready_spread(out_dir, split):
    """When the parameters' gradients become ready in a compiled backward:
    with the forward cut into graphs of about a bucket (``split`` = "1"),
    the last layer's gradients come while earlier layers' backward still
    runs; in one graph ("0") all of them come at its end."""
    torch._dynamo.config.optimize_ddp = split == "1"
    bagua.init_process_group()
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    model = model.with_bagua([opt], Algorithm.init("gradient_allreduce"))
    run = torch.compile(model, backend="aot_eager")
    ready = {}

    def record(name):
        def hook(_):
            ready.setdefault(name, time.perf_counter())
        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(record(name))
    spreads = []
    for step in range(8):
        x = torch.randn(256, 768)
        ready.clear()
        opt.zero_grad()
        run(x).pow(2).mean().backward()
        opt.step()
        if step >= 3:  # after compilation and re-bucketing
            spreads.append(max(ready.values()) - min(ready.values()))
    torch.save({"spreads": spreads}, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
