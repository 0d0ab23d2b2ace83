"""Uneven inputs (run by test_join.py): rank r trains on 4 + 2 * r batches
inside ``join()``, beside PyTorch DDP's ``join()`` on the same batches.

Usage: join_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.fc1 = torch.nn.Linear(10, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def batches(rank):
    g = torch.Generator().manual_seed(40 + rank)
    return [(torch.randn(6, 10, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4 + 2 * rank)]


def wrap(name, model, opt):
    if name == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if name == "qadam":
        return model.with_bagua([opt], Algorithm.init("qadam", q_adam_optimizer=opt))
    kwargs = {"powersgd": dict(start_iter=2), "auto": dict(decide_after=2, verify_steps=2),
              "partial_allreduce": dict(group_size=2, group_generator="static"),
              "async": dict(sync_interval_ms=5)}.get(name, {})
    return model.with_bagua([opt], Algorithm.init(name, **kwargs))


def train(name, rank, divide, accumulate=False):
    model = Net()
    opt = (q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2) if name == "qadam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    wrapped = wrap(name, model, opt)
    with wrapped.join(divide_by_initial_world_size=divide):
        for i, (x, y) in enumerate(batches(rank)):
            opt.zero_grad()
            if accumulate:  # two micro-batches, the first one in no_sync()
                with wrapped.no_sync():
                    F.cross_entropy(wrapped(x[:3]), y[:3]).backward()
                F.cross_entropy(wrapped(x[3:]), y[3:]).backward()
            else:
                F.cross_entropy(wrapped(x), y).backward()
            opt.step()
    result = {"weights": [p.detach().clone() for p in model.parameters()],
              "buffers": [b.detach().clone() for b in model.buffers()]}
    if name != "ddp":
        model.without_bagua()
    return result


def scenario_uneven(out_dir, names, divides):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for divide in [d == "True" for d in divides.split(",")]:
        for name in ["ddp"] + names.split(","):
            results[f"{name}/{divide}"] = train(name, rank, divide)
    results["accumulate/ddp"] = train("ddp", rank, True, accumulate=True)
    results["accumulate/gradient_allreduce"] = train("gradient_allreduce", rank, True, accumulate=True)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def gan_models():
    torch.manual_seed(1)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
    discriminator = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return generator, discriminator, torch.optim.SGD(generator.parameters(), lr=0.05), \
        torch.optim.SGD(discriminator.parameters(), lr=0.05)


def gan_iteration(G, D, opt_g, opt_d, real, z, active=True):
    """One iteration of the DCGAN loop. ``active=False``: the reference's
    stand-in for a rank that ran out (DDP's Join cannot shadow a model run
    three times an iteration): every backward from zero gradients, with a
    loss weighted 0, and no optimizer step, which is what join() promises."""
    weight = 1.0 if active else 0.0
    opt_d.zero_grad()
    F.binary_cross_entropy_with_logits(D(real), torch.ones(6, 1)).mul(weight).backward()
    fake = G(z)
    if not active:
        opt_d.zero_grad()
    F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(6, 1)).mul(weight).backward()
    if active:
        opt_d.step()
    opt_g.zero_grad()
    if not active:
        opt_d.zero_grad()
    F.binary_cross_entropy_with_logits(D(fake), torch.ones(6, 1)).mul(weight).backward()
    if active:
        opt_g.step()


def scenario_gan(out_dir):
    """Two models in one join: the DCGAN loop on uneven data, against DDP
    running the longest rank's number of iterations everywhere (see
    gan_iteration) and the last rank's weights broadcast at the end."""
    bagua.init_process_group()
    rank, world_size = bagua.get_rank(), bagua.get_world_size()
    mine, longest = batches(rank), len(batches(world_size - 1))
    noise = [torch.randn(6, 4, generator=torch.Generator().manual_seed(rank * 100 + i)) for i in range(longest)]
    results = {}
    generator, discriminator, opt_g, opt_d = gan_models()
    G, D = (torch.nn.parallel.DistributedDataParallel(m) for m in (generator, discriminator))
    for i in range(longest):
        active = i < len(mine)
        gan_iteration(G, D, opt_g, opt_d, mine[min(i, len(mine) - 1)][0], noise[i], active)
    for p in list(generator.parameters()) + list(discriminator.parameters()):
        torch.distributed.broadcast(p.data, world_size - 1)
    results["ddp"] = [[p.detach().clone() for p in m.parameters()] for m in (generator, discriminator)]

    generator, discriminator, opt_g, opt_d = gan_models()
    G = generator.with_bagua([opt_g], Algorithm.init("gradient_allreduce"))
    D = discriminator.with_bagua([opt_d], Algorithm.init("gradient_allreduce"))
    with bagua.join([G, D]):
        for i, (real, _) in enumerate(mine):
            gan_iteration(G, D, opt_g, opt_d, real, noise[i])
    results["gradient_allreduce"] = [[p.detach().clone() for p in m.parameters()] for m in (generator, discriminator)]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _train_joined(wrapped, opt, data):
    with wrapped.join():
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            opt.step()


def scenario_nested_and_threads(out_dir):
    """A join() inside another model's join() on the same thread is refused
    at once (it would hang on uneven data); on two threads, one model each,
    the joins are independent: each model ends with the bits it has when
    trained alone, on uneven data."""
    bagua.init_process_group()
    rank = bagua.get_rank()

    def fresh(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, model.with_bagua([opt], Algorithm.init("gradient_allreduce"))

    (a, _, wa), (b, _, wb) = fresh(1), fresh(2)
    nested_error = None
    try:
        with wa.join():
            with wb.join():
                pass
    except Exception as caught:  # noqa: BLE001 - the test reads it
        nested_error = f"{type(caught).__name__}: {caught}"
    bagua.barrier()
    data = {seed: [(x + seed, y) for x, y in batches(rank)] for seed in (1, 2)}
    alone = {}
    for seed in (1, 2):
        model, opt, wrapped = fresh(seed)
        _train_joined(wrapped, opt, data[seed])
        alone[seed] = [p.detach().clone() for p in model.parameters()]
    import threading

    runs = {seed: fresh(seed) for seed in (1, 2)}
    errors = []

    def run(seed):
        try:
            model, opt, wrapped = runs[seed]
            _train_joined(wrapped, opt, data[seed])
        except BaseException as caught:  # noqa: BLE001 - reported below
            errors.append(f"{type(caught).__name__}: {caught}")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threaded = {seed: [p.detach().clone() for p in runs[seed][0].parameters()] for seed in (1, 2)}
    torch.save({"nested_error": nested_error, "errors": errors, "alone": alone, "threaded": threaded},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_no_join(out_dir):
    """Uneven inputs without join(): the error must point to join()."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.with_bagua([opt], Algorithm.init("gradient_allreduce"))
    error = None
    try:
        for x, y in batches(rank):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        bagua.barrier()  # rank 0 waits here for its peer, which waits in its backward
    except Exception as caught:  # noqa: BLE001 - the test reads it
        error = f"{type(caught).__name__}: {caught}"
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
