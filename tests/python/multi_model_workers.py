"""Several wrapped models in one process (run by test_multi_models.py), each
beside its PyTorch DDP twin: a GAN loop as PyTorch's DCGAN example writes
it, one loss through two models of the same shapes, alternating steps,
models on the default group and on a new group at once, and two models
trained from two threads.

The two models of a kind have the same shapes and a small bucket size, so
their buckets pair up size for size: had their collectives been mixed on one
connection, A's gradient would be summed with a peer's B gradient without
any error. Only the comparison with DDP can see that, so every kind is
compared with it.

Usage: multi_model_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam

STEPS = 6
WIDTH = 24


def mlp(seed, inputs=12, outputs=12):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, outputs))


def optimizer_and_algorithm(name, model):
    """An optimizer for ``model`` and, for bagua, the algorithm ``name``
    (``"ddp"``: PyTorch's DDP, no algorithm)."""
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        return opt, Algorithm.init("qadam", q_adam_optimizer=opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "ddp":
        return opt, None
    kwargs = {"powersgd": dict(start_iter=2), "auto": dict(decide_after=2, verify_steps=2),
              "partial_allreduce": dict(group_size=2, group_generator="static"),
              "async": dict(sync_interval_ms=5), "decentralized": dict(peer_selection_mode="all")}.get(name, {})
    return opt, Algorithm.init(name, **kwargs)


def wrap(name, model, group=None):
    """``model`` trained by ``name``, on ``group`` (a pair: bagua's group
    and torch's group over the same ranks; None: the default ones)."""
    opt, algorithm = optimizer_and_algorithm(name, model)
    if algorithm is None:
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group and group[1]), opt, None
    wrapped = model.with_bagua([opt], algorithm, process_group=group and group[0])
    return wrapped, opt, algorithm


def batches(rank, seed, steps=STEPS, batch=8, inputs=12):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randn(batch, inputs, generator=g), torch.randn(batch, 12, generator=g)) for _ in range(steps)]


def gan(name, rank, one_backward):
    """PyTorch's DCGAN loop (examples/dcgan/main.py): the D step backpropagates
    D(real) and D(G(z).detach()), separately or (``one_backward``) as one
    loss through D twice; the G step backpropagates D(G(z)), so D's
    gradients are produced, and reduced, once more."""
    generator, discriminator = mlp(1, inputs=6), mlp(2, outputs=1)
    G, opt_g, _ = wrap(name, generator)
    D, opt_d, _ = wrap(name, discriminator)
    g = torch.Generator().manual_seed(700 + rank)
    for _ in range(STEPS):
        real, z = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
        opt_d.zero_grad()
        loss_real = F.binary_cross_entropy_with_logits(D(real), ones)
        fake = G(z)
        if one_backward:
            (loss_real + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)).backward()
        else:
            loss_real.backward()
            F.binary_cross_entropy_with_logits(D(fake.detach()), zeros).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(D(fake), ones).backward()
        opt_g.step()
    return [generator, discriminator]


def joint(name, rank):
    """One loss through two models of the same shapes (an ensemble, a
    teacher trained with its student): both backwards run at once."""
    a, b = mlp(3), mlp(4)
    A, opt_a, _ = wrap(name, a)
    B, opt_b, _ = wrap(name, b)
    for x, y in batches(rank, 5):
        opt_a.zero_grad()
        opt_b.zero_grad()
        F.mse_loss(A(x) + B(x), y).backward()
        opt_a.step()
        opt_b.step()
    return [a, b]


def alternating(name, rank):
    """A's step, then B's, then A's again: their backwards one after another."""
    a, b = mlp(5), mlp(6)
    A, opt_a, _ = wrap(name, a)
    B, opt_b, _ = wrap(name, b)
    for x, y in batches(rank, 6):
        for model, opt in ((A, opt_a), (B, opt_b)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return [a, b]


def two_groups(name, rank, world_size):
    """A on the default group, B on a new group of the same ranks, one loss
    through both."""
    ranks = list(range(world_size))
    group = (bagua.new_group(ranks), dist.new_group(ranks))
    a, b = mlp(7), mlp(8)
    A, opt_a, _ = wrap(name, a)
    B, opt_b, _ = wrap(name, b, group)
    for x, y in batches(rank, 7):
        opt_a.zero_grad()
        opt_b.zero_grad()
        F.mse_loss(A(x) * B(x), y).backward()
        opt_a.step()
        opt_b.step()
    return [a, b]


def threads(name, rank):
    """A and B trained at the same time from two threads (bagua only: two
    DDPs on one torch group would mix their collectives). The twins are
    trained one after the other: each model's training is its own."""
    a, b = mlp(9), mlp(10)
    runs = [(wrap(name, a), batches(rank, 9)), (wrap(name, b), batches(rank, 10))]
    if name == "ddp":
        for (model, opt, _), data in runs:
            train_alone(model, opt, data)
        return [a, b]
    errors = []

    def train(model, opt, data):
        try:
            train_alone(model, opt, data)
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    workers = [threading.Thread(target=train, args=(model, opt, data)) for (model, opt, _), data in runs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return [a, b]


def train_alone(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def run(kind, name, rank, world_size):
    if kind == "gan":
        models = gan(name, rank, one_backward=False)
    elif kind == "gan_one_backward":
        models = gan(name, rank, one_backward=True)
    elif kind == "two_groups":
        models = two_groups(name, rank, world_size)
    else:
        models = globals()[kind](name, rank)
    weights = [[p.detach().clone() for p in m.parameters()] for m in models]
    for model in models:
        if hasattr(model, "bagua_ddp") and model.bagua_ddp is not None:
            impl = model.bagua_ddp.bagua_algorithm_impl
            if hasattr(impl, "abort"):  # async: stop its background averaging before the next kind
                model.bagua_ddp.bagua_algorithm.abort(model)
            model.without_bagua()
    return weights


def scenario_multi(out_dir, kinds, names):
    bagua.init_process_group()
    rank, world_size = bagua.get_rank(), bagua.get_world_size()
    results = {}
    for kind in kinds.split(","):
        for name in ["ddp"] + names.split(","):
            results[f"{kind}/{name}"] = run(kind, name, rank, world_size)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_ddp_on_top(out_dir):
    """A module wrapped by bagua, then by torch's DDP (what Hugging Face's
    Trainer does with the model it is given): refused, saying why; after
    without_bagua() DDP takes it."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model = mlp(1)
    model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], Algorithm.init("bytegrad"))
    try:
        torch.nn.parallel.DistributedDataParallel(model)
        error = None
    except bagua.InvalidArgumentError as caught:
        error = str(caught)
    model.without_bagua()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    F.mse_loss(ddp(torch.randn(4, 12)), torch.randn(4, 12)).backward()
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
