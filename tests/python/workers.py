"""Worker scenarios run on several processes by launcher.run_workers.

Usage: workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its results to
OUT_DIR/rank{RANK}.pt for the test to compare.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_core
import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm


class Net(torch.nn.Module):
    """Layers of unequal sizes so buckets come out unequal."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 37)
        self.fc2 = torch.nn.Linear(37, 13)
        self.fc3 = torch.nn.Linear(13, 5)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batches(rank, steps=10, batch=16):
    """The same per-rank data for every run."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, 20, generator=g), torch.randint(0, 5, (batch,), generator=g))
            for _ in range(steps)]


def fresh_model_and_optimizer(kind):
    torch.manual_seed(7)
    model = Net()
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def train(model, opt, data, set_to_none):
    for x, y in data:
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def scenario_ddp_equivalence(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank)
    results = {}
    for kind in ("sgd", "adam"):
        model, opt = fresh_model_and_optimizer(kind)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        results[f"ddp/{kind}"] = train(ddp, opt, data, set_to_none=False)
        variants = {
            "default": dict(hierarchical=None, do_flatten=True, set_to_none=False),
            "flat": dict(hierarchical=False, do_flatten=True, set_to_none=False),
            "hierarchical": dict(hierarchical=True, do_flatten=True, set_to_none=True),
            "unflattened": dict(hierarchical=False, do_flatten=False, set_to_none=True),
        }
        for name, v in variants.items():
            model, opt = fresh_model_and_optimizer(kind)
            algorithm = (GradientAllReduceAlgorithm() if v["hierarchical"] is None
                         else GradientAllReduceAlgorithm(hierarchical=v["hierarchical"]))
            model = model.with_bagua([opt], algorithm, do_flatten=v["do_flatten"])
            forms = []  # the form each step's buckets ran in
            model.register_forward_pre_hook(
                lambda module, inputs: forms.append(module.bagua_ddp.bagua_algorithm_impl.hierarchical))
            results[f"bagua/{kind}/{name}"] = train(model, opt, data, set_to_none=v["set_to_none"])
            results[f"buckets/{kind}/{name}"] = [len(b.tensors) for b in model.bagua_buckets]
            if name == "default":
                results[f"decision/{kind}"] = model.bagua_ddp.bagua_algorithm_impl.hierarchy.decision
                results[f"forms/{kind}"] = forms
    from bagua.torch_api.process_group import _get_default_group

    results["two_levels"] = _get_default_group().spans_nodes_of_several_ranks()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _inputs(dtype, rank, n, op="sum"):
    g = torch.Generator().manual_seed(rank * 31 + n)
    if op == "product":
        values = torch.randint(1, 3, (n,), generator=g)
    else:
        values = torch.randint(0, 20, (n,), generator=g)
    return values.to(dtype)


def scenario_primitives(out_dir):
    """Every primitive against torch.distributed on the same inputs."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
              torch.uint8]
    ops = {"sum": (bagua.ReduceOp.SUM, dist.ReduceOp.SUM), "max": (bagua.ReduceOp.MAX, dist.ReduceOp.MAX),
           "min": (bagua.ReduceOp.MIN, dist.ReduceOp.MIN),
           "product": (bagua.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT)}
    for dtype in dtypes:
        # torch's Gloo reduces fp16/bf16 only on some builds: reference in float64.
        ref_dtype = torch.float64 if dtype in (torch.float16, torch.bfloat16) else dtype
        for n in (1, 7, 1001):
            key = f"{dtype}/{n}"
            for op_name, (ours, theirs) in ops.items():
                x = _inputs(dtype, rank, n, op_name)
                out = torch.empty_like(x)
                bagua.allreduce(x, out, op=ours)
                ref = x.to(ref_dtype)
                dist.all_reduce(ref, op=theirs)
                results[f"allreduce/{op_name}/{key}"] = (out, ref.to(dtype))
            x = _inputs(dtype, rank, n)
            avg = x.clone()
            bagua.allreduce_inplace(avg, op=bagua.ReduceOp.AVG)
            ref = x.to(torch.float64)
            dist.all_reduce(ref)
            ref = ref / world
            if not dtype.is_floating_point:
                ref = torch.trunc(ref)
            results[f"allreduce/avg/{key}"] = (avg, ref.to(dtype))

            root = world - 1
            out = torch.zeros_like(x)
            bagua.reduce(x, out, dst=root)
            ref = x.to(ref_dtype)
            dist.reduce(ref, dst=root)
            if rank == root:
                results[f"reduce/{key}"] = (out, ref.to(dtype))

            b = _inputs(dtype, rank, n)
            ref = b.to(ref_dtype)
            bagua.broadcast(b, src=world // 2)
            dist.broadcast(ref, src=world // 2)
            results[f"broadcast/{key}"] = (b, ref.to(dtype))

            gathered = torch.empty(n * world, dtype=dtype)
            bagua.allgather(x, gathered)
            ref_list = [torch.empty(n, dtype=ref_dtype) for _ in range(world)]
            dist.all_gather(ref_list, x.to(ref_dtype))
            results[f"allgather/{key}"] = (gathered, torch.cat(ref_list).to(dtype))
            in_place = torch.zeros(n * world, dtype=dtype)
            in_place[rank * n:(rank + 1) * n] = x
            bagua.allgather_inplace(in_place)
            results[f"allgather_inplace/{key}"] = (in_place, torch.cat(ref_list).to(dtype))

            gathered = torch.zeros(n * world, dtype=dtype)
            bagua.gather(x, gathered, dst=0)
            ref_list = [torch.zeros(n, dtype=ref_dtype) for _ in range(world)] if rank == 0 else None
            dist.gather(x.to(ref_dtype), ref_list, dst=0)
            if rank == 0:
                results[f"gather/{key}"] = (gathered, torch.cat(ref_list).to(dtype))

            source = _inputs(dtype, rank + 100, n * world)
            chunk = torch.zeros(n, dtype=dtype)
            bagua.scatter(source, chunk, src=0)
            ref = torch.zeros(n, dtype=ref_dtype)
            dist.scatter(ref, list(source.to(ref_dtype).chunk(world)) if rank == 0 else None, src=0)
            results[f"scatter/{key}"] = (chunk, ref.to(dtype))

            whole = _inputs(dtype, rank + 200, n * world)
            part = torch.zeros(n, dtype=dtype)
            bagua.reduce_scatter(whole, part)
            in_place = whole.clone()
            bagua.reduce_scatter_inplace(in_place)
            ref = whole.to(torch.float64)
            dist.all_reduce(ref)  # Gloo has no reduce_scatter: reduce then take our chunk
            results[f"reduce_scatter/{key}"] = (part, ref[rank * n:(rank + 1) * n].to(dtype))
            results[f"reduce_scatter_inplace/{key}"] = (in_place[rank * n:(rank + 1) * n],
                                                        ref[rank * n:(rank + 1) * n].to(dtype))

            send = _inputs(dtype, rank + 300, n * world)
            recv = torch.zeros_like(send)
            bagua.alltoall(send, recv)
            everyone = [torch.zeros(n * world, dtype=ref_dtype) for _ in range(world)]
            dist.all_gather(everyone, send.to(ref_dtype))
            ref = torch.cat([everyone[j][rank * n:(rank + 1) * n] for j in range(world)])
            results[f"alltoall/{key}"] = (recv, ref.to(dtype))

            if world > 1:
                right, left = (rank + 1) % world, (rank - 1) % world
                message = _inputs(dtype, rank + 400, n)
                incoming = torch.zeros(n, dtype=dtype)
                if rank % 2 == 0:
                    bagua.send(message, right)
                    bagua.recv(incoming, left)
                else:
                    bagua.recv(incoming, left)
                    bagua.send(message, right)
                results[f"send_recv/{key}"] = (incoming, _inputs(dtype, left + 400, n))
    bagua.barrier()
    # A subgroup of the even ranks.
    evens = list(range(0, world, 2))
    group = bagua.new_group(evens)
    if not bagua.communication._rank_not_in_group(group):
        t = torch.tensor([float(rank)])
        bagua.allreduce_inplace(t, comm=group)
        results["subgroup/even_sum"] = (t, torch.tensor([float(sum(evens))]))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _capture(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - we record whatever was raised
        return type(error).__name__, str(error), [c.__name__ for c in type(error).__mro__]
    return None


def scenario_errors(out_dir):
    """Bad input on 2+ ranks: each case's exception (or None) per rank."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    results["unsupported_dtype"] = _capture(lambda: bagua.allreduce_inplace(torch.zeros(3, dtype=torch.complex64)))
    results["non_contiguous"] = _capture(lambda: bagua.allreduce_inplace(torch.zeros(4, 4).t()))
    results["sizes_differ"] = _capture(lambda: bagua.allreduce_inplace(torch.zeros(5 if rank == 1 else 4)))
    results["dtypes_differ"] = _capture(lambda: bagua.broadcast(
        torch.zeros(4, dtype=torch.float64 if rank == 0 else torch.float32), 0))
    # The group still works after the refused calls.
    t = torch.ones(3)
    bagua.allreduce_inplace(t)
    results["after_errors"] = t.tolist()
    results["bad_reduce_op"] = _capture(lambda: bagua.allreduce_inplace(torch.zeros(3), op=bagua.ReduceOp.BXOR))
    results["bad_root"] = _capture(lambda: bagua.broadcast(torch.zeros(3), src=bagua.get_world_size()))
    results["algorithm_argument"] = _capture(lambda: GradientAllReduceAlgorithm(hierarchical="yes"))
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    results["second_with_bagua"] = _capture(lambda: model.with_bagua([opt], GradientAllReduceAlgorithm()))
    model.without_bagua()
    results["rewrap_after_reset"] = _capture(lambda: model.with_bagua([opt], GradientAllReduceAlgorithm()))
    results["bad_optimizer_list"] = _capture(lambda: Net().with_bagua(["sgd"], GradientAllReduceAlgorithm()))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


class Reordered(torch.nn.Module):
    """Registered in another order than used: its gradients become ready in an
    order that differs from the reverse registration order."""

    def __init__(self):
        super().__init__()
        self.last = torch.nn.Linear(13, 5)
        self.first = torch.nn.Linear(20, 37)
        self.middle = torch.nn.Linear(37, 13)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def _bucket_order(model):
    return [t.bagua_tensor_name for b in model.bagua_buckets for t in b.tensors]


def scenario_replan(out_dir):
    """Buckets re-planned from the profiled ready order, results still DDP's."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank)
    torch.manual_seed(3)
    reference = Reordered()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    ddp_params = train(torch.nn.parallel.DistributedDataParallel(reference), opt, data, False)

    torch.manual_seed(3)
    model = Reordered()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    initial = _bucket_order(model)
    params = train(model, opt, data, set_to_none=True)
    results = {
        "ddp": ddp_params, "bagua": params, "initial_order": initial,
        "final_order": _bucket_order(model),
        "ready_order": model.bagua_ddp._bagua_backend.last_ready_order(),
        "stats": model.bagua_ddp.communication_stats(),
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_straggler_timeout(out_dir):
    """Rank 1 wraps the model and then never communicates: rank 0's step must
    fail after BAGUA_COMM_TIMEOUT_S with an error naming rank, op and bucket."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    results = {}
    if rank == 1:
        import time

        time.sleep(float(os.environ["BAGUA_COMM_TIMEOUT_S"]) * 3)
    else:
        import time

        x, y = batches(rank, steps=1)[0]
        start = time.monotonic()
        results["error"] = _capture(lambda: F.cross_entropy(model(x), y).backward())
        results["seconds"] = time.monotonic() - start
        # later waits keep failing the same way rather than hanging
        results["again"] = _capture(lambda: model.bagua_ddp.wait_pending_comm_ops())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_python_op_error(out_dir):
    """An exception raised by a python op reaches the training thread."""
    from bagua.torch_api.algorithms import Algorithm, AlgorithmImpl

    class FailingImpl(AlgorithmImpl):
        def init_operations(self, bagua_ddp, bucket):
            bucket.clear_ops()
            bucket.append_centralized_synchronous_op(group=self.process_group)

            def fail(name):
                raise KeyError(f"no such thing in {name}")

            bucket.append_python_op(fail)

    class Failing(Algorithm):
        def reify(self, process_group):
            return FailingImpl(process_group)

    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], Failing())
    x, y = batches(rank, steps=1)[0]
    results = {"error": _capture(lambda: F.cross_entropy(model(x), y).backward())}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_qadam(out_dir):
    """QAdam: warmup equals DDP + torch.optim.Adam; afterwards ranks agree."""
    from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=12)
    torch.manual_seed(7)
    reference = Net()
    adam = torch.optim.Adam(reference.parameters(), lr=0.01)
    ddp = torch.nn.parallel.DistributedDataParallel(reference) if bagua.get_world_size() > 1 else reference
    adam_params = train(ddp, adam, data[:6], set_to_none=False)

    torch.manual_seed(7)
    model = Net()
    opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=6)
    model = model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=False))
    warmup_params = train(model, opt, data[:6], set_to_none=True)
    compressed_params = train(model, opt, data[6:], set_to_none=True)
    stats = model.bagua_ddp.communication_stats()
    torch.save({"adam": adam_params, "qadam_warmup": warmup_params, "qadam_after": compressed_params,
                "ops": [op["name"] for b in stats["buckets"] for op in b["ops"]],
                "tensors": [t.bagua_tensor_name for t in model.bagua_ddp.bagua_tensors]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_bytegrad(out_dir):
    """ByteGrad through the Python bucket API: gradients averaged within the
    quantization bound of an exact allreduce, flat and hierarchical."""
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    x, y = batches(rank, steps=1)[0]
    results = {}
    for hierarchical in (False, True):
        model, opt = fresh_model_and_optimizer("sgd")
        local = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(x), y).backward()
        local_grads = [p.grad.detach().clone() for p in model.parameters()]
        exact = [g.clone() for g in local_grads]
        for g in exact:
            dist.all_reduce(g)
            g /= bagua.get_world_size()
        model, opt = fresh_model_and_optimizer("sgd")
        model = model.with_bagua([opt], ByteGradAlgorithm(hierarchical=hierarchical))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        results[hierarchical] = {"bagua": [p.grad.detach().clone() for p in model.parameters()],
                                 "exact": exact, "local": local_grads,
                                 "bytes": model.bagua_ddp.communication_stats()}
        del local
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_low_precision_decentralized(out_dir):
    """Per step: every rank's copies before and after, and its gradient, so
    the test can check the ring invariant and recompute the update."""
    from bagua.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    lr = 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    algorithm = LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    model = model.with_bagua([opt], algorithm)
    impl = model.bagua_ddp.bagua_algorithm_impl
    (bucket,) = model.bagua_buckets  # one bucket: the whole model
    steps = []
    for x, y in batches(rank, steps=4):
        before = [t.clone() for t in impl.peer_weights[bucket.name]]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad = torch.cat([t.grad.reshape(-1) for t in bucket.tensors])
        opt.step()
        after = [t.clone() for t in impl.peer_weights[bucket.name]]
        params = torch.cat([t.detach().reshape(-1) for t in bucket.tensors])
        steps.append({"before": before, "grad": grad, "after": after, "params": params})
    torch.save({"steps": steps, "lr": lr}, os.path.join(out_dir, f"rank{rank}.pt"))


def lp_topology(kind, n):
    """The graphs the low-precision neighbour tests run on."""
    from bagua.bluefog import topology_util

    return {"exponential": lambda: topology_util.ExponentialGraph(n),
            "ring": lambda: topology_util.RingGraph(n),
            "star": lambda: topology_util.StarGraph(n),
            "mesh": lambda: topology_util.MeshGrid2DGraph(n)}[kind]()


def scenario_low_precision_neighbor(out_dir, kind, lr="0.1", steps="4"):
    """LowPrecisionDecentralizedAlgorithm(topology=...) on Net with SGD: the
    bucket order (as indices of model.parameters()), then per step the
    parameters and the algorithm's copies (W, {in-neighbour: replica}) after
    the optimizer step. lr = 0: the weights are made to differ per rank
    after wrapping, and only averaging moves them."""
    from bagua.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm

    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(7)
    model = Net()
    lr = float(lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    algorithm = LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=lp_topology(kind, n))
    model = model.with_bagua([opt], algorithm)
    impl = model.bagua_ddp.bagua_algorithm_impl
    if lr == 0:
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + rank)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
    records = []
    for x, y in batches(rank, steps=int(steps)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        (bucket,) = model.bagua_buckets  # one bucket: the whole model
        weight, replicas = impl.copies(bucket.name)
        records.append({"params": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]),
                        "bucket": torch.cat([t.bagua_registered_tensor().detach().reshape(-1).clone()
                                             for t in bucket.tensors]),
                        "weight": weight.clone(), "replicas": {r: t.clone() for r, t in replicas.items()}})
    pointers = [p.data_ptr() for p in model.parameters()]
    order = [pointers.index(t.bagua_registered_tensor().data_ptr()) for t in bucket.tensors]
    ops = [op["name"] for b in model.bagua_ddp.communication_stats()["buckets"] for op in b["ops"]]
    torch.save({"steps": records, "lr": lr, "order": order, "ops": ops, "sources": impl.sources},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_decentralized(out_dir, mode, interval="1"):
    """Per step: the weights before forward, the gradient, the weights after
    the optimizer step, for a pure-Python reference of D_FP_S."""
    from bagua.torch_api.algorithms.decentralized import DecentralizedAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7 + rank)  # different starting weights: averaging is visible
    model = Net()
    lr = 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model = model.with_bagua([opt], DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode=mode, communication_interval=int(interval)))
    _record_decentralized_steps(out_dir, model, opt, lr, rank)


def scenario_decentralized_topology(out_dir, kind):
    """As scenario_decentralized, with DecentralizedAlgorithm(topology=...):
    "exponential" (BlueFog's weighted exponential graph), "ring_unweighted"
    (a ring without edge weights: the uniform average) or "dynamic" (the
    dynamic one-peer schedule on the exponential graph)."""
    from bagua.bluefog import topology_util
    from bagua.torch_api.algorithms.decentralized import DecentralizedAlgorithm

    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(7 + rank)
    model = Net()
    lr = 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if kind == "exponential":
        topology = topology_util.ExponentialGraph(n)
    elif kind == "ring_unweighted":
        topology = topology_util.nx.DiGraph()
        topology.add_nodes_from(range(n))
        topology.add_edges_from([(r, (r + 1) % n) for r in range(n)] + [(r, (r - 1) % n) for r in range(n)])
    else:
        topology = topology_util.GetDynamicOnePeerSendRecvRanks(topology_util.ExponentialGraph(n), rank)
    model = model.with_bagua([opt], DecentralizedAlgorithm(hierarchical=False, topology=topology))
    _record_decentralized_steps(out_dir, model, opt, lr, rank)


def _record_decentralized_steps(out_dir, model, opt, lr, rank):
    # wrapping broadcast rank 0's weights; make them differ again per rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * (rank + 1) * torch.ones_like(p))
    steps = []
    for x, y in batches(rank, steps=5):
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
        opt.step()
        after = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        steps.append({"before": before, "grad": grad, "after": after})
    # how many times each bucket's op ran: once per communication step
    executions = [op["executions"] for b in model.bagua_ddp.communication_stats()["buckets"] for op in b["ops"]]
    torch.save({"steps": steps, "lr": lr, "executions": executions},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_async_straggler(out_dir):
    """Step rate of the fast ranks without and with a straggler (rank 3
    sleeping every step), and how far apart the models are."""
    import time

    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=20, warmup_steps=3)
    model = model.with_bagua([opt], algorithm)
    data = batches(rank, steps=40)
    results = {"params_init": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])}

    def run(steps, straggle):
        start = time.perf_counter()
        for x, y in data[:steps]:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            time.sleep(0.01)  # the rest of a training step (data loading...)
            if straggle:
                time.sleep(0.05)
        return steps / (time.perf_counter() - start)

    run(5, False)  # warmup (synchronous) and the switch to asynchronous
    results["rate_unslowed"] = run(30, False)
    bagua.barrier()
    results["rate_straggler"] = run(30, rank == 3)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = torch.zeros(params.numel() * bagua.get_world_size())
    algorithm.abort(model)
    # The same training without any communication, for comparison.
    local = Net()
    with torch.no_grad():
        offset = 0
        for p in local.parameters():
            p.copy_(results["params_init"][offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    train(local, local_opt, data[:5] + data[:30] + data[:30], set_to_none=False)
    local_params = torch.cat([p.detach().reshape(-1) for p in local.parameters()])
    bagua.allgather(local_params.contiguous(), everyone)
    results["params_local"] = everyone.view(bagua.get_world_size(), -1).clone()
    bagua.allgather(params.contiguous(), everyone)
    results["params_trained"] = everyone.view(bagua.get_world_size(), -1).clone()
    # Idle ranks converge: resume, wait a few rounds without training.
    algorithm.resume(model)
    time.sleep(0.3)
    algorithm.abort(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    bagua.allgather(params.contiguous(), everyone)
    results["params_idle"] = everyone.view(bagua.get_world_size(), -1).clone()
    results["status"] = model.bagua_ddp.bagua_algorithm_impl.status()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_async_abort_resume(out_dir):
    """50 abort/resume cycles, each rank training a different number of
    steps in each cycle."""
    import time

    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=5)
    model = model.with_bagua([opt], algorithm)
    x, y = batches(rank, steps=1)[0]
    start = time.perf_counter()
    steps = 0
    for cycle in range(50):
        for _ in range((cycle + rank) % 4 + 1):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
        algorithm.abort(model)
        # training after abort keeps working locally
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
        algorithm.resume(model)
    algorithm.abort(model)
    impl = model.bagua_ddp.bagua_algorithm_impl
    torch.save({"seconds": time.perf_counter() - start, "steps": steps, "status": impl.status(),
                "rounds": [op.completed_rounds for op in impl.ops]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_autotune(out_dir):
    """GradientAllReduce with autotuning: every trial's plan on every rank,
    and the parameters next to DDP's after the same steps."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=16)
    model, opt = fresh_model_and_optimizer("sgd")
    ddp_params = train(torch.nn.parallel.DistributedDataParallel(model), opt, data, set_to_none=False)
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm(), autotune=True)
    layouts = []
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        layouts.append([[t.bagua_tensor_name for t in b.tensors] for b in model.bagua_buckets])
    tuner = model.bagua_ddp.autotuner
    torch.save({"ddp": ddp_params, "bagua": [p.detach().clone() for p in model.parameters()],
                "layouts": layouts, "trials": tuner.trials, "frozen": tuner.frozen,
                "best": tuner.best}, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_autotune_weights(out_dir, algorithm_name):
    """Autotuning with algorithms that communicate weights: training keeps
    working across re-bucketing and the algorithm's invariants hold."""
    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
    from bagua.torch_api.algorithms.decentralized import (DecentralizedAlgorithm,
                                                          LowPrecisionDecentralizedAlgorithm)

    bagua.init_process_group()
    rank = bagua.get_rank()
    make = {"low_precision_decentralized": lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False),
            "decentralized": lambda: DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="ring"),
            "async_model_average": lambda: AsyncModelAverageAlgorithm(sync_interval_ms=5)}[algorithm_name]
    result = {}
    for tuned in (False, True):
        algorithm = make()
        model, opt = fresh_model_and_optimizer("sgd")
        model = model.with_bagua([opt], algorithm, autotune=tuned)
        losses, layouts = [], []
        for x, y in batches(rank, steps=16):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            layouts.append(len(model.bagua_buckets))
        if hasattr(algorithm, "abort"):
            algorithm.abort(model)
        result["losses" if tuned else "losses_untuned"] = losses
        if tuned:
            result.update(layouts=layouts, trials=model.bagua_ddp.autotuner.trials)
    impl = model.bagua_ddp.bagua_algorithm_impl
    if algorithm_name == "low_precision_decentralized":
        # ring invariant after re-bucketing: my weight == my neighbours' copies of it
        result["copies"] = {b.name: [c.clone() for c in impl.peer_weights[b.name]] for b in model.bagua_buckets}
        result["bucket_names"] = [b.name for b in model.bagua_buckets]
    if algorithm_name == "async_model_average":
        result["status"] = impl.status()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_saved_plan(out_dir):
    """A run that loads BAGUA_AUTOTUNE_PLAN starts with the saved bucket size."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    torch.save({"bucket_bytes": model.bagua_ddp.bucket_bytes,
                "layout": [[t.bagua_tensor_name for t in b.tensors] for b in model.bagua_buckets]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_timeline(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    train(model, opt, batches(rank, steps=3), set_to_none=False)
    from bagua.torch_api import timeline

    path = timeline.write()
    torch.save({"path": str(path)}, os.path.join(out_dir, f"rank{rank}.pt"))


def _anonymous_memory_kb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


def scenario_timeline_memory(out_dir):
    """Training with the timeline on keeps its memory: a model of 19 MB of
    gradients, allocated afresh every step (set_to_none), 60 steps. The
    process's anonymous memory and minor page faults from step 20 to 80."""
    import resource

    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1536),
                                torch.nn.ReLU(), torch.nn.Linear(1536, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
    marks = {}
    for step in range(1, 81):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step in (20, 80):
            marks[step] = (_anonymous_memory_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    from bagua.torch_api import timeline

    events = len(timeline.get(rank))
    torch.save({"grown_kb": marks[80][0] - marks[20][0], "faults": marks[80][1] - marks[20][1], "events": events},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_switches(out_dir):
    """Every combination of overlap / flatten / hierarchical equals DDP."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    data = batches(rank, steps=6)
    model, opt = fresh_model_and_optimizer("sgd")
    results = {"ddp": train(torch.nn.parallel.DistributedDataParallel(model), opt, data, set_to_none=False)}
    for overlap in (True, False):
        for flatten in (True, False):
            for hierarchical in (True, False):
                model, opt = fresh_model_and_optimizer("sgd")
                model = model.with_bagua([opt], GradientAllReduceAlgorithm(hierarchical=hierarchical),
                                         do_flatten=flatten, overlap=overlap)
                results[(overlap, flatten, hierarchical)] = train(model, opt, data, set_to_none=False)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_backend_choice(out_dir):
    """BAGUA_BACKEND=nccl where NCCL cannot run: a clear error; CUDA buckets
    on Gloo: refused when the op is appended."""
    rank = int(os.environ["RANK"])
    results = {"nccl": _capture(bagua.init_process_group)}
    if results["nccl"] is None:  # a GPU machine: NCCL works, nothing more to check here
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        return
    os.environ["BAGUA_BACKEND"] = "gloo"
    bagua_core._testing.reload_env()  # the runtime reads BAGUA_* once
    bagua.init_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_retry_after_failed_init(out_dir):
    """init_process_group fails after the launcher's rendezvous (Gloo cannot
    bind a missing interface), then is called again with the interface unset:
    the retry must join the same store, not race a second one on MASTER_PORT."""
    rank = int(os.environ["RANK"])
    results = {"first": _capture(bagua.init_process_group)}
    del os.environ["GLOO_SOCKET_IFNAME"]  # read by init_process_group itself
    bagua.init_process_group()
    t = torch.ones(3) * (rank + 1)
    bagua.allreduce_inplace(t)
    u = torch.ones(2)
    dist.all_reduce(u)  # torch.distributed initialized over the same store
    results["bagua_sum"], results["torch_sum"] = t.tolist(), u.tolist()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
