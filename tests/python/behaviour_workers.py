"""Worker scenarios of test_compat_behaviour.py: Bagua scripts that must run
unchanged (run on several processes by launcher.run_workers(script=...)).

Usage: behaviour_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import atexit
import gc
import inspect
import json
import os
import sys
import time
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from workers import Net, _capture, batches, fresh_model_and_optimizer, train


def _save(out_dir, results):
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def _step(model, opt, x, y, set_to_none=False):
    opt.zero_grad(set_to_none=set_to_none)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# -- 1. an LR scheduler with a wrapped optimizer -------------------------------
def _train_with_scheduler(model, opt, sched, data):
    for x, y in data:
        _step(model, opt, x, y)
        sched.step()
    return _params(model)


def scenario_lr_scheduler(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=4)
    results = {}

    model, opt = fresh_model_and_optimizer("sgd")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    results["ddp"] = _train_with_scheduler(ddp, opt, sched, data)

    for when in ("after", "before"):
        model, opt = fresh_model_and_optimizer("sgd")
        post_hook_calls = []
        if hasattr(opt, "register_step_post_hook"):  # torch >= 2.0
            opt.register_step_post_hook(lambda *args: post_hook_calls.append(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = None
            try:
                if when == "before":
                    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                model = model.with_bagua([opt], GradientAllReduceAlgorithm())
                bound = inspect.ismethod(opt.step) and opt.step.__self__ is opt
                if when == "after":
                    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                params = _train_with_scheduler(model, opt, sched, data)
            except Exception as error:  # noqa: BLE001 - recorded for the test
                outcome = f"{type(error).__name__}: {error}"
                params = bound = None
        results[when] = {
            "error": outcome, "params": params,
            "warnings": [str(w.message) for w in caught],
            "lr": [g["lr"] for g in opt.param_groups],
            "bound": bound,
            "post_hook_calls": len(post_hook_calls) if hasattr(opt, "register_step_post_hook") else None,
        }
        if outcome is None:
            model.without_bagua()
    _save(out_dir, results)


# -- 2. switching algorithms by calling with_bagua again -----------------------
def _algorithm(name, model, opt):
    from bagua.torch_api.algorithms import bytegrad, decentralized
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    if name == "gradient_allreduce":
        return GradientAllReduceAlgorithm(), opt
    if name == "bytegrad":
        return bytegrad.ByteGradAlgorithm(hierarchical=False), opt
    if name == "decentralized":
        return decentralized.DecentralizedAlgorithm(hierarchical=False), opt
    if name in ("async", "async_no_abort"):
        return AsyncModelAverageAlgorithm(sync_interval_ms=5), opt
    if name == "low_prec_decentralized":
        return decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False), opt
    if name == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
        return QAdamAlgorithm(opt, hierarchical=False), opt
    raise ValueError(name)


def scenario_model_switch(out_dir):
    """Bagua's test_model_switch: one model, one algorithm after another,
    each by calling with_bagua on the already wrapped module."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sequence = ["bytegrad", "decentralized", "gradient_allreduce", "qadam", "async",
                "low_prec_decentralized", "async_no_abort", "gradient_allreduce"]
    results = {"errors": {}, "async_status_after_switch": {}, "engines_alive": None}
    engines = []
    previous_async_impl = None
    for index, name in enumerate(sequence):
        algorithm, opt = _algorithm(name, model, opt)
        try:
            model = model.with_bagua([opt], algorithm)
        except Exception as error:  # noqa: BLE001
            results["errors"][index] = f"{type(error).__name__}: {error}"
            break
        if previous_async_impl is not None:
            results["async_status_after_switch"][sequence[index - 1]] = previous_async_impl.status()
            previous_async_impl = None
        engines.append(weakref.ref(model.bagua_ddp))
        if name == "async":
            model.bagua_algorithm.resume(model)
        for x, y in batches(rank + 10 * index, steps=6):
            _step(model, opt, x, y, set_to_none=True)
        if name == "async":
            model.bagua_algorithm.abort(model)
        if name.startswith("async"):
            previous_async_impl = model.bagua_ddp.bagua_algorithm_impl
    gc.collect()
    results["engines_alive"] = [ref() is not None for ref in engines]
    results["params"] = _params(model)
    results["class"] = type(model).__mro__[1].__name__
    _save(out_dir, results)


# -- 3. new_group for ranks outside the group ----------------------------------
def scenario_new_group(out_dir):
    from bagua.torch_api.communication import _rank_not_in_group

    bagua.init_process_group()
    rank = bagua.get_rank()
    group = bagua.new_group([0, 2])
    results = {"is_none": group is None, "not_in_group": _rank_not_in_group(group),
               "none_not_in_group": _rank_not_in_group(None)}
    t = torch.tensor([float(rank + 1)])
    results["allreduce"] = _capture(lambda: bagua.allreduce_inplace(t, comm=group))
    results["value"] = t.item()
    results["ranks"] = getattr(group, "ranks", None)
    # the default group still works for everyone
    ones = torch.ones(2)
    bagua.allreduce_inplace(ones)
    results["after"] = ones.tolist()
    _save(out_dir, results)


# -- 4. the torch tensor is the bagua tensor ------------------------------------
def scenario_bagua_style_algorithm(out_dir):
    """An algorithm written as Bagua's are: parameters made bagua tensors in
    place, buckets of them, marked ready on the parameter itself."""
    from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl
    from bagua.torch_api.bucket import BaguaBucket

    class Impl(AlgorithmImpl):
        def init_tensors(self, bagua_ddp):
            tensors = []
            for name, param in bagua_ddp.bagua_build_params():
                param = param.bagua_ensure_grad().ensure_bagua_tensor(
                    name, bagua_ddp.bagua_module_name,
                    getter_closure=lambda p: p.grad,
                    setter_closure=lambda p, t: setattr(p, "grad", t))
                tensors.append(param)
            self.names = [t.bagua_tensor_name for t in tensors]
            return list(reversed(tensors))

        def tensors_to_buckets(self, tensors, do_flatten):
            return [BaguaBucket(group, flatten=do_flatten, name=str(i)) for i, group in enumerate(tensors)]

        def init_operations(self, bagua_ddp, bucket):
            bucket.clear_ops()
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True)

        def init_backward_hook(self, bagua_ddp):
            def hook(parameter_name, parameter):
                if parameter_name in self.names:
                    parameter.bagua_mark_communication_ready()
            return hook

    class BaguaStyle(Algorithm):
        def reify(self, process_group):
            return Impl(process_group)

    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=4)
    model, opt = fresh_model_and_optimizer("sgd")
    reference = train(torch.nn.parallel.DistributedDataParallel(model), opt, data, set_to_none=False)
    model, opt = fresh_model_and_optimizer("sgd")
    results = {"error": None}
    try:
        model = model.with_bagua([opt], BaguaStyle())
        results["params"] = train(model, opt, data, set_to_none=True)
        params = list(model.parameters())
        bucketed = [t for b in model.bagua_buckets for t in b.tensors]
        results["buckets_hold_parameters"] = all(any(t is p for p in params) for t in bucketed)
        results["ddp_tensors_are_parameters"] = all(
            any(model.bagua_ddp.bagua_tensor_by_name(n) is p for p in params)
            for n, _ in model.bagua_ddp.bagua_build_params())
    except Exception as error:  # noqa: BLE001
        results["error"] = f"{type(error).__name__}: {error}"
    results["reference"] = reference
    _save(out_dir, results)


# -- 5. a clean exit --------------------------------------------------------------
def scenario_exit(out_dir):
    """Async training, then exit without any cleanup; rank 1 lingers so its
    background thread outlives rank 0. Registered before bagua's handlers,
    this rank's own atexit handler runs after them and records what is left."""
    rank = int(os.environ["RANK"])
    state = {}

    def after_bagua_shutdown():
        state["torch_pg_initialized"] = dist.is_initialized()
        state["async_status"] = [op.get_status() for op in state.pop("ops", [])]
        with open(os.path.join(out_dir, f"rank{rank}_exit.json"), "w") as f:
            json.dump(state, f)

    atexit.register(after_bagua_shutdown)
    bagua.init_process_group()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=5))
    for x, y in batches(rank, steps=5):
        _step(model, opt, x, y)
    state["ops"] = list(model.bagua_ddp.bagua_algorithm_impl.ops)
    _save(out_dir, {"done": True})
    if rank == 1:
        time.sleep(1.0)


def scenario_exit_joined_group(out_dir):
    """The script made torch's group itself (as torchrun scripts, Accelerate
    and Trainer do), bagua joined it, a DDP with bagua's hook trained; no
    cleanup. The handler registered first runs last: is torch's group gone?"""
    rank = int(os.environ["RANK"])

    def after_bagua_shutdown():
        with open(os.path.join(out_dir, f"rank{rank}_exit.json"), "w") as f:
            json.dump({"torch_pg_initialized": dist.is_initialized()}, f)

    atexit.register(after_bagua_shutdown)
    dist.init_process_group("gloo")
    bagua.init_process_group()
    from bagua.torch_api import ddp_hooks
    model, opt = fresh_model_and_optimizer("sgd")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_hooks.register(ddp, "bytegrad")
    for x, y in batches(rank, steps=3):
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    _save(out_dir, {"done": True})


# -- 7. a parameter unused on one rank ---------------------------------------------
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 16)
        self.extra = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 5)

    def forward(self, x, use_extra=True):
        h = torch.relu(self.fc1(x))
        if use_extra:
            h = h + torch.relu(self.extra(h))
        return self.fc2(h)


def scenario_unused_parameter(out_dir, kind="sgd"):
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=5)
    use_extra = rank != 1

    def run(model, opt):
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x, use_extra), y).backward()
            opt.step()
        return [p.detach().clone() for p in (model.module if hasattr(model, "module") else model).parameters()]

    def fresh():
        torch.manual_seed(7)
        model = Branchy()
        if kind == "sgd":
            return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, opt = fresh()
    results = {"ddp": run(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True), opt)}
    model, opt = fresh()
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    results["bagua"] = run(model, opt)
    _save(out_dir, results)


# -- 8, 9, 10. asynchronous model average and the weight lock ------------------------
class TwoPart(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(20, 16)
        self.b = torch.nn.Linear(16, 5)
        self.probe = None  # called in the middle of forward when set

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.probe is not None:
            self.probe()
        return self.b(h)


def _rounds(model):
    return sum(op.completed_rounds for op in model.bagua_ddp.bagua_algorithm_impl.ops)


def _async_model(two_optimizers):
    torch.manual_seed(7)
    model = TwoPart()
    if two_optimizers:
        opts = [torch.optim.SGD(model.a.parameters(), lr=0.05), torch.optim.SGD(model.b.parameters(), lr=0.05)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.05)]
    model = model.with_bagua(opts, AsyncModelAverageAlgorithm(sync_interval_ms=5))
    return model, opts


def scenario_async_two_optimizers(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opts = _async_model(two_optimizers=True)
    gaps = []
    for x, y in batches(rank, steps=3):
        for o in opts:
            o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        bagua.barrier()
        opts[0].step()
        r0 = _rounds(model)
        time.sleep(0.3)  # between the two optimizers' steps: the weights are still being written
        r1 = _rounds(model)
        opts[1].step()
        time.sleep(0.3)  # after the last one: averaging goes on
        r2 = _rounds(model)
        gaps.append((r1 - r0, r2 - r1))
    model.bagua_algorithm.abort(model)
    _save(out_dir, {"gaps": gaps})


def scenario_async_eval_forward(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, (opt,) = _async_model(two_optimizers=False)
    data = batches(rank, steps=4)
    for x, y in data[:3]:
        _step(model, opt, x, y)
    measured = {}

    def probe():
        r0 = _rounds(model)
        time.sleep(0.3)
        measured["during"] = _rounds(model) - r0

    results = {}
    for mode in ("no_grad", "eval"):
        bagua.barrier()
        model.probe = probe
        if mode == "no_grad":
            with torch.no_grad():
                model(data[3][0])
        else:
            model.eval()
            model(data[3][0])
            model.train()
        model.probe = None
        r0 = _rounds(model)
        time.sleep(0.3)
        results[mode] = {"during": measured.pop("during"), "after": _rounds(model) - r0}
    # training goes on afterwards
    _step(model, opt, *data[0])
    model.bagua_algorithm.abort(model)
    _save(out_dir, results)


def scenario_async_without_bagua(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, (opt,) = _async_model(two_optimizers=False)
    for x, y in batches(rank, steps=3):
        _step(model, opt, x, y)
    impl = model.bagua_ddp.bagua_algorithm_impl
    model.without_bagua()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank + 1))
    before = _params(model)
    r0 = sum(op.completed_rounds for op in impl.ops)
    time.sleep(0.5)
    results = {"status": impl.status(), "rounds_after": sum(op.completed_rounds for op in impl.ops) - r0,
               "unchanged": all(torch.equal(a, b) for a, b in zip(before, _params(model))),
               "is_bagua_module": isinstance(model, bagua.BaguaModule)}
    _save(out_dir, results)


# -- no_sync ------------------------------------------------------------------------
def scenario_no_sync(out_dir, set_to_none="0"):
    set_to_none = set_to_none == "1"
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=12)

    def run(model, opt, stats=None):
        for step in range(4):
            micro = data[3 * step:3 * step + 3]
            opt.zero_grad(set_to_none=set_to_none)
            with model.no_sync():
                for x, y in micro[:-1]:
                    F.cross_entropy(model(x), y).backward()
            x, y = micro[-1]
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in opt.param_groups[0]["params"]]

    model, opt = fresh_model_and_optimizer("sgd")
    results = {"ddp": run(torch.nn.parallel.DistributedDataParallel(model), opt)}
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    results["error"] = None
    try:
        results["bagua"] = run(model, opt)
        stats = model.bagua_ddp.communication_stats()
        results["executions"] = [op["executions"] for b in stats["buckets"] for op in b["ops"]]
    except Exception as error:  # noqa: BLE001
        results["error"] = f"{type(error).__name__}: {error}"
    _save(out_dir, results)


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
