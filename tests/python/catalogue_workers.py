"""Worker scenarios for the error catalogue (docs/errors.md), run by
test_error_catalogue.py through launcher.run_workers.

Usage: catalogue_workers.py SCENARIO OUT_DIR; each rank saves a dict of
case -> outcome to OUT_DIR/rank{RANK}.pt. An outcome is None (nothing
raised) or (exception name, message, names of its classes).
"""

import atexit
import os
import sys
import time

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import async_model_average, bytegrad, decentralized, gradient_allreduce
from bagua.torch_api.algorithms import partial_allreduce, powersgd, q_adam
from bagua.torch_api.bucket import BaguaBucket


def capture(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - we record whatever was raised
        return type(error).__name__, str(error), [c.__name__ for c in type(error).__mro__]
    return None


def save(results, out_dir):
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def wrap(model, algorithm=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model.with_bagua([opt], algorithm or gradient_allreduce.GradientAllReduceAlgorithm()), opt


def step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def primitive_cases(rank, world):
    """Arguments wrong on some ranks or all: every rank raises."""
    return {
        "allgather_output_size_on_one_rank": lambda: bagua.allgather(
            torch.ones(3), torch.zeros(3 * world + (1 if rank == world - 1 else 0))),
        "gather_output_size_on_the_root": lambda: bagua.gather(
            torch.ones(2), torch.zeros(2 * world + (1 if rank == 0 else 0)), dst=0),
        "reduce_scatter_indivisible": lambda: bagua.reduce_scatter_inplace(torch.ones(3 * world + 1)),
        "alltoall_indivisible": lambda: bagua.alltoall(torch.ones(3 * world + 1), torch.zeros(3 * world + 1)),
        "not_a_tensor": lambda: bagua.allreduce_inplace([1.0, 2.0]),
        "meta_tensor": lambda: bagua.allreduce_inplace(torch.empty(3, device="meta")),
        "bool_tensor": lambda: bagua.allreduce_inplace(torch.ones(3, dtype=torch.bool)),
        "send_to_self": lambda: bagua.send(torch.ones(2), dst=rank),
        "send_out_of_range": lambda: bagua.send(torch.ones(2), dst=world + 3),
        "new_group_out_of_range": lambda: bagua.new_group([0, world + 2]),
        "new_group_duplicates": lambda: bagua.new_group([0, 0]),
    }


def algorithm_argument_cases():
    param = torch.nn.Parameter(torch.ones(2))
    return {
        "bytegrad_average": lambda: bytegrad.ByteGradAlgorithm(average="x"),
        "decentralized_mode": lambda: decentralized.DecentralizedAlgorithm(peer_selection_mode="nope"),
        "decentralized_interval": lambda: decentralized.DecentralizedAlgorithm(communication_interval=0),
        "low_precision_interval": lambda: decentralized.LowPrecisionDecentralizedAlgorithm(
            communication_interval=-1),
        "qadam_warmup": lambda: q_adam.QAdamOptimizer([param], warmup_steps=-1),
        "qadam_lr": lambda: q_adam.QAdamOptimizer([param], lr=-1.0),
        "async_interval": lambda: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=-1),
        "powersgd_rank": lambda: powersgd.PowerSGDAlgorithm(rank=0),
        "partial_group_size": lambda: partial_allreduce.PartialAllReduceAlgorithm(group_size=0),
    }


def model_cases(rank):
    def tensor_twice():
        t = torch.ones(4).ensure_bagua_tensor("catalogue_t")
        BaguaBucket([t, t], name="twice")

    def mixed_bucket():
        a = torch.ones(4).ensure_bagua_tensor("catalogue_a")
        b = torch.ones(4, dtype=torch.float64).ensure_bagua_tensor("catalogue_b")
        BaguaBucket([a, b], name="mixed")

    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    return {
        "model_shape_differs": lambda: wrap(torch.nn.Linear(4, 3 if rank == 0 else 2)),
        "model_count_differs": lambda: wrap(torch.nn.Sequential(*[torch.nn.Linear(4, 4)
                                                                  for _ in range(1 + (rank == 0))])),
        "empty_model": lambda: torch.nn.Sequential().with_bagua(
            [torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)],
            gradient_allreduce.GradientAllReduceAlgorithm()),
        "frozen_model": lambda: frozen.with_bagua([torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)],
                                                  gradient_allreduce.GradientAllReduceAlgorithm()),
        "tensor_twice_in_a_bucket": tensor_twice,
        "dtypes_mixed_in_a_bucket": mixed_bucket,
    }


def scenario_catalogue(out_dir):
    """Every case on every rank, then proof that the group still works and
    that a model of mixed dtypes trains to equal replicas."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    for cases in (primitive_cases(rank, world), algorithm_argument_cases(), model_cases(rank)):
        for name, fn in cases.items():
            results[name] = capture(fn)
    t = torch.ones(3)
    bagua.allreduce_inplace(t)
    results["group_still_works"] = t.tolist()
    # Mixed dtypes in one model: buckets per dtype, replicas stay equal.
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double())
    model, opt = wrap(model)
    for _ in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        opt.zero_grad()
        model[1](model[0](x).double()).sum().backward()
        opt.step()
    results["mixed_dtype_model_weights"] = [p.detach().clone() for p in model.parameters()]
    save(results, out_dir)


def scenario_after_shutdown(out_dir):
    """A training step and a collective after bagua shut down at exit (from
    an exit handler registered before init_process_group: they run last)."""
    results = {}

    def after():
        results["collective"] = capture(lambda: bagua.allreduce_inplace(torch.ones(2)))
        results["forward"] = capture(lambda: step(model, opt, torch.ones(2, 4)))
        torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))

    atexit.register(after)
    bagua.init_process_group()
    model, opt = wrap(torch.nn.Linear(4, 2))
    step(model, opt, torch.ones(2, 4))


def scenario_port_in_use(out_dir):
    """init_process_group where another program holds MASTER_PORT."""
    start = time.monotonic()
    results = {"init": capture(bagua.init_process_group), "seconds": None}
    results["seconds"] = time.monotonic() - start
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2])
