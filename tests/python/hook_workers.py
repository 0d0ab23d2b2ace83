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
from bagua.torch_api._core import InvalidArgumentError
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


def scenario_equal(out_dir):
    """One bucket each. DDP's first backward lays its bucket out in module
    order and later ones in ready order; the hook's op takes the gradients
    in bagua's order either way (reverse module order), so from the first
    step on it computes what with_bagua computes: through a copy on the
    first step, on DDP's buffer itself after the rebuild."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    hooked = mlp()
    opt = torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(hooked, bucket_cap_mb=100)
    state = ddp_hooks.ByteGradState(hooked)
    ddp.register_comm_hook(state, ddp_hooks.bytegrad_hook)
    train(ddp, opt, rank)
    viewed = mlp()  # the gradients are views of DDP's bucket, which the op rewrites in place
    opt = torch.optim.SGD(viewed.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(viewed, bucket_cap_mb=100, gradient_as_bucket_view=True)
    ddp.register_comm_hook(ddp_hooks.ByteGradState(viewed), ddp_hooks.bytegrad_hook)
    train(ddp, opt, rank)
    ours = mlp()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ours.with_bagua([opt], bytegrad.ByteGradAlgorithm(hierarchical=False))
    train(ours, opt, rank)
    torch.save({"hook": [p.detach().clone() for p in hooked.parameters()],
                "bagua": [p.detach().clone() for p in ours.parameters()],
                "viewed": [p.detach().clone() for p in viewed.parameters()],
                "buckets": len(ours.bagua_ddp.bagua_buckets), "bucket_runs": state.bucket_runs},
               os.path.join(out_dir, f"rank{rank}.pt"))


def powersgd_ddp(model, kwargs, hook_state=None):
    """``model`` in DDP with bagua's PowerSGD hook (its state loaded from
    ``hook_state`` when given), and its SGD optimizer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
    state = ddp_hooks.PowerSGDState(model, **kwargs)
    if hook_state is not None:
        state.load_state_dict(hook_state)
    ddp.register_comm_hook(state, ddp_hooks.powersgd_hook)
    return model, opt, ddp, state


def scenario_powersgd(out_dir, low_precision):
    """PowerSGD's hook against with_bagua's PowerSGD, compressing from the
    third step; then the hook's state saved after 4 steps and loaded into a
    fresh DDP and state resumes bit for bit."""
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm
    bagua.init_process_group()
    rank = bagua.get_rank()
    kwargs = dict(rank=2, start_iter=2, min_compression_rate=1.0, low_precision=low_precision == "1")
    hooked = mlp()
    opt = torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(hooked, bucket_cap_mb=100)
    state = ddp_hooks.PowerSGDState(hooked, **kwargs)
    ddp.register_comm_hook(state, ddp_hooks.powersgd_hook)
    train(ddp, opt, rank, steps=6)
    ours = mlp()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ours.with_bagua([opt_ours], PowerSGDAlgorithm(**kwargs))
    train(ours, opt_ours, rank, steps=6)
    result = {"hook": [p.detach().clone() for p in hooked.parameters()],
              "bagua": [p.detach().clone() for p in ours.parameters()]}
    # Resuming: 4 steps, save model, optimizer and hook state; 3 more; then
    # a fresh DDP and state loaded from the save, 3 more: the same bits.
    runs = []
    for resumed in (False, True):
        model, opt, ddp, state = powersgd_ddp(mlp(), kwargs)
        train(ddp, opt, rank, steps=4)
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "opt": __import__("copy").deepcopy(opt.state_dict()), "hook": state.state_dict()}
        if resumed:
            fresh = mlp()
            fresh.load_state_dict(saved["model"])
            model, opt, ddp, state = powersgd_ddp(fresh, kwargs, saved["hook"])
            opt.load_state_dict(saved["opt"])
        g = torch.Generator().manual_seed(500 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    result["continued"], result["resumed"] = runs
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_digits(out_dir, epochs="12"):
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    x_train, y_train, x_test, y_test = load_data(0)
    shard = slice(rank, None, world)
    x, y = x_train[shard], y_train[shard]
    results = {}
    for kind in ("ddp", "bytegrad_hook", "powersgd_hook", "powersgd8_hook"):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if kind == "bytegrad_hook":
            ddp.register_comm_hook(ddp_hooks.ByteGradState(model), ddp_hooks.bytegrad_hook)
        elif kind.startswith("powersgd"):
            state = ddp_hooks.PowerSGDState(model, rank=2, start_iter=10, low_precision=kind == "powersgd8_hook")
            ddp.register_comm_hook(state, ddp_hooks.powersgd_hook)
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


class _Branchy(torch.nn.Module):
    """A body and a branch the forward uses on even steps only (DDP with
    find_unused_parameters=True then reduces a zero gradient for it)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 120), torch.nn.Tanh(), torch.nn.Linear(120, 5))
        self.branch = torch.nn.Linear(16, 5)

    def forward(self, x, step):
        return self.body(x) + self.branch(x) if step % 2 == 0 else self.body(x)


def _hooked_pair_member(name):
    """Model ``a`` (three layers, several DDP buckets) or ``b`` (_Branchy,
    find_unused_parameters=True), each with a ByteGrad hook state of its own."""
    torch.manual_seed({"a": 11, "b": 12}[name])
    if name == "a":
        module = torch.nn.Sequential(torch.nn.Linear(16, 200), torch.nn.ReLU(), torch.nn.Linear(200, 150),
                                     torch.nn.ReLU(), torch.nn.Linear(150, 5))
    else:
        module = _Branchy()
    ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.05, find_unused_parameters=(name == "b"))
    state = ddp_hooks.ByteGradState(module)
    ddp.register_comm_hook(state, ddp_hooks.bytegrad_hook)
    return ddp, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9), state


def _train_hooked(names, rank, steps=8):
    """Trains the models ``names`` (a subset of a, b) in one process, with
    their backwards interleaved as a GAN's or a distillation loop's are:
    A's then B's, B's then A's, one backward of A's and B's losses summed,
    and at step 3 a first micro-batch under no_sync(). Every rank and every
    subset draws the same batches. Returns each model's weights and how many
    buckets its hook reduced."""
    models = {n: _hooked_pair_member(n) for n in names}
    g = torch.Generator().manual_seed(70 + rank)

    def loss(n, step, x, y):
        ddp = models[n][0]
        return F.cross_entropy(ddp(x) if n == "a" else ddp(x, step), y)

    for step in range(steps):
        data = {n: [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
                for n in "ab"}
        for n in names:
            models[n][1].zero_grad()
        if step == 3:
            for n in names:
                with models[n][0].no_sync():
                    loss(n, step, *data[n][0]).backward()
        if len(names) == 2 and step % 3 == 0 and step != 3:
            (loss("a", step, *data["a"][1]) + loss("b", step, *data["b"][1])).backward()
        else:
            for n in (list(reversed(names)) if step % 2 else names):
                loss(n, step, *data[n][1]).backward()
        for n in names:
            models[n][1].step()
    return {n: {"weights": [p.detach().clone() for p in models[n][0].module.parameters()],
                "bucket_runs": sum(models[n][2].bucket_runs.values())} for n in names}


def scenario_two_models(out_dir):
    """Two DDP models with ByteGrad hooks in one process (interleaved and
    combined backwards, no_sync, an unused branch) against each alone."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.save({"together": _train_hooked(["a", "b"], rank), "a": _train_hooked(["a"], rank)["a"],
                "b": _train_hooked(["b"], rank)["b"]}, os.path.join(out_dir, f"rank{rank}.pt"))


def _uneven_run(hook, rank, world, join):
    """Rank r trains on 3 + 2 r batches through a DDP with bagua's ``hook``.
    ``join``: under torch's Join, where a rank out of data shadows the
    others' buckets with zeros through the hook. Otherwise the reference: a
    rank out of data runs backwards of zero gradients (no optimizer step)
    until the longest rank is done, which is what Join stands for."""
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(5)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    if hook == "bytegrad":
        ddp.register_comm_hook(ddp_hooks.ByteGradState(module), ddp_hooks.bytegrad_hook)
    else:
        ddp.register_comm_hook(ddp_hooks.PowerSGDState(module, rank=1, start_iter=2), ddp_hooks.powersgd_hook)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(40 + rank)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3 + 2 * rank)]
    if join:
        with Join([ddp]):
            for x, y in batches:
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
    else:
        for step in range(3 + 2 * (world - 1)):
            x, y = batches[min(step, len(batches) - 1)]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            if step < len(batches):
                loss.backward()
                opt.step()
            else:
                (0 * loss).backward()
    return [p.detach().clone() for p in module.parameters()]


def scenario_join(out_dir, hook):
    """Uneven data under torch's Join through bagua's hook, against the
    padded reference (see _uneven_run)."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    torch.save({"joined": _uneven_run(hook, rank, world, True), "padded": _uneven_run(hook, rank, world, False)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _train_in_group(group, seed, member):
    """A DDP over ``group`` with a ByteGrad hook state over the same group,
    6 steps on batches of ``seed`` and this rank's ``member`` index."""
    torch.manual_seed(8)
    module = torch.nn.Sequential(torch.nn.Linear(16, 120), torch.nn.ReLU(), torch.nn.Linear(120, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=group)
    ddp.register_comm_hook(ddp_hooks.ByteGradState(module, process_group=group), ddp_hooks.bytegrad_hook)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1000 * seed + member)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in module.parameters()]


def scenario_subgroups(out_dir):
    """Ranks 0-1 and 2-3 train two DDPs of their own, each over its own
    torch group with a hook state over that group; run twice, the second
    time with other data for the second group only."""
    import torch.distributed as dist

    bagua.init_process_group()
    rank = bagua.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, member = rank // 2, rank % 2
    runs = [_train_in_group(groups[mine], seed=mine if run == 0 else mine * 7, member=member) for run in range(2)]
    module = torch.nn.Linear(4, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=groups[mine])
    try:  # the state left on the default group (all 4 ranks)
        ddp_hooks.ByteGradState(module)
        refusal = None
    except InvalidArgumentError as error:
        refusal = str(error)
    torch.save({"group": mine, "runs": runs, "refusal": refusal}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
