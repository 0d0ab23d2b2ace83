"""One training step of a tiny model (a few KB of gradients) with
GradientAllReduce, run by test_netns_harness.py on each emulated host
through bench/netns.py's launch_on_hosts: ``netns_step_worker.py --worker
--out OUT``. Rank 0 writes to OUT whether every rank ended with the same
weights, and the interface Gloo was told to use."""

import json
import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm


def main(out):
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.zeros(world * flat.numel())
    bagua.allgather(flat, gathered)
    equal = all(torch.equal(part, flat) for part in gathered.view(world, -1))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"equal": equal, "gradient_bytes": 4 * flat.numel(),
                       "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}, f)


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1])
