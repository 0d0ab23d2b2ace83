"""Worker scenarios of test_floatgrad.py, run on several processes by
launcher.run_workers. Usage: floatgrad_workers.py SCENARIO OUT_DIR; each
rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.algorithms.bytegrad import Float16GradAlgorithm
from bagua.torch_api.bucket import BaguaBucket
from workers import batches, fresh_model_and_optimizer, train

# Float16GradAlgorithm's variants: (algorithm arguments, do_flatten, the DDP
# hook it must equal). "by_name" is built through the registry.
VARIANTS = {
    "hierarchical": (dict(hierarchical=True), True, "fp16"),
    "flat": (dict(hierarchical=False), True, "fp16"),
    "unflattened": (dict(hierarchical=False), False, "fp16"),
    "sum": (dict(hierarchical=False, average=False), True, "fp16_sum"),
    "by_name": (None, True, "fp16"),
}


def fp16_sum_hook(process_group, bucket):
    """fp16_compress_hook without the division: the reference of average=False."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16)
    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


HOOKS = {"fp16": fp16_compress_hook, "fp16_sum": fp16_sum_hook, "fp32": None}


def train_ddp(kind, data, hook):
    model, opt = fresh_model_and_optimizer(kind)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if HOOKS[hook] is not None:
        ddp.register_comm_hook(None, HOOKS[hook])
    return train(ddp, opt, data, set_to_none=False)


def train_bagua(kind, data, arguments, do_flatten):
    model, opt = fresh_model_and_optimizer(kind)
    if arguments is None:
        algorithm = Algorithm.init("floatgrad")
        assert type(algorithm) is Float16GradAlgorithm
    else:
        algorithm = Float16GradAlgorithm(**arguments)
    model = model.with_bagua([opt], algorithm, do_flatten=do_flatten)
    params = train(model, opt, data, set_to_none=True)
    return params, [len(b.tensors) for b in model.bagua_buckets], model.bagua_buckets[0].backend_bucket.op_names


def scenario_ddp_fp16_hook(out_dir):
    """Float16GradAlgorithm's variants and DDP with the matching hook (and
    without one), 10 steps of SGD with momentum and of Adam."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank)
    results = {}
    for kind in ("sgd", "adam"):
        for hook in HOOKS:
            results[f"ddp/{kind}/{hook}"] = train_ddp(kind, data, hook)
        for name, (arguments, do_flatten, hook) in VARIANTS.items():
            params, buckets, ops = train_bagua(kind, data, arguments, do_flatten)
            results[f"bagua/{kind}/{name}"] = params
            results[f"buckets/{kind}/{name}"] = buckets
            results[f"ops/{kind}/{name}"] = ops
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def error_of(call):
    """The message of the bagua.InvalidArgumentError `call` raises, or None."""
    try:
        call()
    except bagua.InvalidArgumentError as e:
        return str(e)
    return None


def bucket_of(dtype, name):
    return BaguaBucket([torch.ones(6, dtype=dtype).ensure_bagua_tensor(f"floatgrad_{name}")], name=name)


def scenario_bad_input(out_dir):
    """What Float16 refuses, each message saved."""
    bagua.init_process_group()
    rank = bagua.get_rank()

    def bfloat16_model():
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], Float16GradAlgorithm())

    errors = {
        "int32": lambda: bucket_of(torch.int32, "int32").append_centralized_synchronous_op(compression="Float16"),
        "int64": lambda: bucket_of(torch.int64, "int64").append_centralized_synchronous_op(
            compression="Float16", hierarchical=True),
        "bfloat16_bucket": lambda: bucket_of(torch.bfloat16, "bf16").append_centralized_synchronous_op(
            compression="Float16"),
        "bfloat16_model": bfloat16_model,
        "scattergather": lambda: bucket_of(torch.float32, "sg").append_centralized_synchronous_op(
            compression="Float16", scattergather=True),
        "error_feedback": lambda: bucket_of(torch.float32, "ef").append_centralized_synchronous_op(
            compression="Float16", error_feedback=True),
        "unknown": lambda: bucket_of(torch.float32, "unknown").append_centralized_synchronous_op(
            compression="Float8"),
        # accepted: float32, float64 and float16 buckets
        "float32": lambda: bucket_of(torch.float32, "f32").append_centralized_synchronous_op(compression="Float16"),
        "float64": lambda: bucket_of(torch.float64, "f64").append_centralized_synchronous_op(compression="Float16"),
        "float16": lambda: bucket_of(torch.float16, "f16").append_centralized_synchronous_op(compression="Float16"),
    }
    torch.save({name: error_of(call) for name, call in errors.items()}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
