"""Worker scenarios of test_partial_allreduce.py (Ripples: P-Reduce, the group
generator service, PartialAllReduceAlgorithm), run on several processes by
launcher.run_workers. Usage: partial_workers.py SCENARIO OUT_DIR [ARGS...];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys
import time

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua


def _save(out_dir, results):
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def _inputs(rank, n, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def scenario_primitive(out_dir):
    """Rounds of disjoint random groups (every rank draws the same partition
    from a shared seed); each member keeps its result and every rank knows
    every input, so the test compares against a float64 mean."""
    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    results = {"rounds": []}
    shared = torch.Generator().manual_seed(7)
    for round_index, (numel, dtype) in enumerate([(0, torch.float32), (1, torch.float32),
                                                  (1001, torch.float32), (257, torch.float64),
                                                  (300_007, torch.float32), (999, torch.float16),
                                                  (999, torch.bfloat16)]):
        order = torch.randperm(n, generator=shared).tolist()
        cut = int(torch.randint(1, n + 1, (1,), generator=shared))
        groups = [sorted(order[:cut]), sorted(order[cut:])]
        mine = next(g for g in groups if rank in g)
        x = _inputs(rank + 10 * round_index, numel, dtype)
        before = x.clone()
        bagua.partial_allreduce_inplace(x, mine)
        results["rounds"].append({"numel": numel, "dtype": str(dtype), "groups": groups,
                                  "input": before, "output": x})
    # The whole group is allreduce.
    x = _inputs(rank, 5000, torch.float64)
    y = x.clone()
    bagua.partial_allreduce_inplace(x, list(range(n)))
    bagua.allreduce_inplace(y, op=bagua.ReduceOp.AVG)
    results["all_vs_allreduce"] = (x - y).abs().max().item()
    # Bad member lists are ValueErrors before any communication.
    errors = []
    for bad in ([], [rank, rank], [n], [r for r in range(n) if r != rank] or [n + 1], ["0"], "01"):
        try:
            bagua.partial_allreduce_inplace(torch.zeros(3), bad)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    results["errors"] = errors
    # Group ids by member set: two sets called in the same order by members.
    t = torch.full((10,), float(rank))
    for _ in range(5):
        bagua.partial_allreduce_inplace(t, list(range(n)))
    results["repeated"] = t
    _save(out_dir, results)


def scenario_service(out_dir, mode, group_size):
    """The GroupGenerator from Python: each rank takes a rank-dependent number
    of groups, P-Reduces a vector within each, then closes (draining)."""
    from bagua.torch_api.algorithms.partial_allreduce import GroupGenerator
    bagua.init_process_group()
    rank = bagua.get_rank()
    gen = GroupGenerator(group_size=int(group_size), mode=mode, seed=3)
    x = torch.full((64,), float(rank * rank), dtype=torch.float64)
    for _ in range(10 + 5 * rank):
        with gen.acquire() as group:
            bagua.partial_allreduce_inplace(x, group.ranks, group_id=group.id)
    gen.close(drain=lambda group: bagua.partial_allreduce_inplace(x, group.ranks, group_id=group.id))
    _save(out_dir, {"x": x, "history": gen.history(), "stats": gen.stats()})


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def scenario_train(out_dir, generator, overlap, lr, interval="1", group_size="3", low_precision="0"):
    """PartialAllReduceAlgorithm with plain SGD; ranks start from different
    weights and stop at different step counts (abort at their own step).
    Saves what I1 (lr = 0: serial replay) and I2 (conservation) need."""
    from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm
    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(0)
    model = _Net()
    lr = float(lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    algorithm = PartialAllReduceAlgorithm(group_size=min(int(group_size), n), group_generator=generator,
                                          overlap=overlap == "1", communication_interval=int(interval),
                                          low_precision=low_precision == "1")
    model = model.with_bagua([opt], algorithm)
    with torch.no_grad():  # after with_bagua's broadcast: every rank its own start
        g = torch.Generator().manual_seed(100 + rank)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    start = _flat(model)
    grad_sum = torch.zeros_like(start)
    data = torch.Generator().manual_seed(rank)
    steps = 12 + 4 * rank
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data)
        y = torch.randint(0, 3, (16,), generator=data)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad_sum += torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
        opt.step()
        if rank == n - 1:
            time.sleep(0.004)  # a slower rank
    algorithm.abort(model)
    _save(out_dir, {"start": start, "end": _flat(model), "grad_sum": grad_sum, "lr": lr,
                    "history": algorithm.history(model), "stats": algorithm.stats(model),
                    "comm_stats": model.bagua_ddp.communication_stats()["algorithm_ops"]})


def scenario_straggler(out_dir, seconds="3"):
    """Smart P-Reduce with the slowdown filter (threshold 5, groups of 3) and
    the last rank 3x slower, compute emulated by sleeping between forward and
    backward as in bench/ripples_accuracy.py; every rank trains for the same
    wall time. Saves what the bounded-isolation test needs."""
    from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm
    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = PartialAllReduceAlgorithm(group_size=3, slowdown_threshold=5)
    model = model.with_bagua([opt], algorithm)
    data = torch.Generator().manual_seed(rank)
    sleep_s = 0.02 * (3 if rank == n - 1 else 1)
    bagua.barrier()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < float(seconds):
        x = torch.randn(16, 8, generator=data)
        y = torch.randint(0, 3, (16,), generator=data)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        time.sleep(sleep_s)
        loss.backward()
        opt.step()
        steps += 1
    algorithm.abort(model)
    _save(out_dir, {"steps": steps, "history": algorithm.history(model), "stats": algorithm.stats(model)})


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
