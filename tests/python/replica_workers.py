"""The replica check (run by test_replicas.py): every algorithm that keeps
replicas equal trains with check_replicas_every=1 and never trips it; then
one rank's weight is nudged by one unit in the last place and the check must
name it on every rank.

Usage: replica_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam


def model_and_optimizer(name):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        return model, opt, Algorithm.init("qadam", q_adam_optimizer=opt)
    kwargs = {"powersgd": dict(start_iter=2), "auto": dict(decide_after=2, verify_steps=2)}.get(name, {})
    return model, torch.optim.SGD(model.parameters(), lr=0.1), Algorithm.init(name, **kwargs)


def train(model, opt, rank, steps, nudge_at=None):
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == nudge_at and rank == 1:
            with torch.no_grad():  # one unit in the last place, on one element, on one rank
                w = model[2].weight
                w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(float("inf")))


def scenario_quiet(out_dir, names):
    bagua.init_process_group()
    rank = bagua.get_rank()
    for name in names.split(","):
        model, opt, algorithm = model_and_optimizer(name)
        model.with_bagua([opt], algorithm, check_replicas_every=1)
        train(model, opt, rank, 6)
        model.without_bagua()
    torch.save({"ok": True}, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_nudged(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt, algorithm = model_and_optimizer("gradient_allreduce")
    model.with_bagua([opt], algorithm)  # BAGUA_CHECK_REPLICAS from the environment
    error = None
    try:
        train(model, opt, rank, 12, nudge_at=8)
    except bagua.ReplicasDivergedError as caught:
        error = str(caught)
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
