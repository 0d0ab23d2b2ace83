"""Worker scenarios of asynchronous model average's bounded staleness, drift
figures and final average, run by test_async_model_average.py through
launcher.run_workers(script=...)."""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from workers import Net, batches


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _gather(tensor):
    everyone = torch.zeros(tensor.numel() * bagua.get_world_size())
    bagua.allgather(tensor.contiguous(), everyone)
    return everyone.view(bagua.get_world_size(), -1).clone()


def _step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def scenario_bounded(out_dir, bound):
    """Fast steps, slow rounds (100 ms): the stats with the bound (an int)
    or without ("none"), then abort and a final synchronous average."""
    from bagua.torch_api import timeline

    bound = None if bound == "none" else int(bound)
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=100, max_staleness_steps=bound)
    model = model.with_bagua([opt], algorithm)
    # each rank its own data (the replicas drift) and its own step count
    data = batches(rank, steps=30 + 2 * rank)
    for x, y in data:
        _step(model, opt, x, y)
    deadline = time.monotonic() + 10
    while algorithm.stats(model)["rounds"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # unbounded: 30 steps may beat the first round
    stats = algorithm.stats(model)
    for x, y in data[:2]:  # idle rounds made the replicas equal: differ again
        _step(model, opt, x, y)
    algorithm.abort(model)
    before = _gather(_flat(model))
    algorithm.abort(model, average=True)
    after = _gather(_flat(model))
    path = timeline.write()
    events = json.loads(path.read_text())["traceEvents"] if path else []
    torch.save({"stats": stats, "before": before, "after": after,
                "rounds": [e for e in events if e["name"] == "async_round"],
                "waits": [e for e in events if e["name"] == "staleness_wait"],
                "status": model.bagua_ddp.bagua_algorithm_impl.status()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_stalled_peer(out_dir):
    """Rank 1 stalls inside a step (holding the weights) past the timeout:
    rank 0, bounded to one step per round, must not wait forever."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=10, max_staleness_steps=1)
    model = model.with_bagua([opt], algorithm)
    x, y = batches(rank, steps=1)[0]
    _step(model, opt, x, y)
    result = {"error": None}
    start = time.monotonic()
    if rank == 1:
        impl = model.bagua_ddp.bagua_algorithm_impl
        impl.lock(model.bagua_ddp)  # a step that never ends (until we give up)
        time.sleep(8)
        impl.unlock(model.bagua_ddp)
    else:
        try:
            for _ in range(1000):
                _step(model, opt, x, y)
        except Exception as error:  # noqa: BLE001 - the test checks what it was
            result["error"] = f"{type(error).__name__}: {error}"
            result["is_bagua_error"] = isinstance(error, bagua.BaguaError)
    result["seconds"] = time.monotonic() - start
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # the peer's communicator is broken: skip the orderly shutdown


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
