import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
"""Worker scenarios of test_compat_api.py (Bagua's API beyond the
primitives), run on several processes by launcher.run_workers like
workers.py. Each checks bagua against torch.distributed's Gloo collectives
on the same process group, or against results computed in plain Python.

Usage: compat_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api import communication as comm_api
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm


def _save(results, rank, out_dir):
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _capture(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return f"{type(error).__name__}: {error}"
    return None


def _payload(rank, peer, count, dtype):
    """What rank `rank` sends rank `peer` in the alltoall_v checks: known to all."""
    return (torch.arange(count, dtype=torch.int64) + 1000 * rank + 100 * peer).to(dtype)


def _count_matrix(world, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (world, world), generator=g)
    counts[0, world - 1] = 0  # always one empty exchange
    return counts.tolist()


def _alltoall_v_checks(results, rank, world):
    for dtype in (torch.float32, torch.int64, torch.float16):
        counts = _count_matrix(world, seed=11)
        # Contiguous layout: torch's all_to_all_single with split sizes is the reference.
        send_counts = counts[rank]
        recv_counts = [counts[i][rank] for i in range(world)]
        send = torch.cat([_payload(rank, j, send_counts[j], dtype) for j in range(world)])
        send_displs = [sum(send_counts[:j]) for j in range(world)]
        recv_displs = [sum(recv_counts[:i]) for i in range(world)]
        ours = torch.full((sum(recv_counts),), -1, dtype=dtype)
        bagua.alltoall_v(send, send_counts, send_displs, ours, recv_counts, recv_displs)
        ref = torch.full_like(ours, -1).to(torch.float64)
        dist.all_to_all_single(ref, send.to(torch.float64), recv_counts, send_counts)
        results[f"alltoall_v/contiguous/{dtype}"] = (ours, ref.to(dtype))
        # Bagua's example passes the displacements with the total appended
        # (one more entry than ranks): the same result.
        ours = torch.full((sum(recv_counts),), -1, dtype=dtype)
        bagua.alltoall_v(send, send_counts, send_displs + [sum(send_counts)], ours, recv_counts,
                         recv_displs + [sum(recv_counts)])
        results[f"alltoall_v/total_appended/{dtype}"] = (ours, ref.to(dtype))

        # Gaps, reversed order and larger capacities than needed: plain Python reference.
        send_displs = [3 * sum(send_counts[j + 1:]) + 2 for j in range(world)]
        send = torch.full((3 * sum(send_counts) + 10,), -7, dtype=dtype)
        for j in range(world):
            send[send_displs[j]:send_displs[j] + send_counts[j]] = _payload(rank, j, send_counts[j], dtype)
        capacity = [c + 2 for c in recv_counts]
        recv_displs = [sum(capacity[:i]) + i for i in range(world)]
        ours = torch.full((sum(capacity) + world,), -1, dtype=dtype)
        bagua.alltoall_v(send, send_counts, send_displs, ours, capacity, recv_displs)
        expected = torch.full_like(ours, -1)
        for i in range(world):
            expected[recv_displs[i]:recv_displs[i] + recv_counts[i]] = _payload(i, rank, recv_counts[i], dtype)
        results[f"alltoall_v/gaps/{dtype}"] = (ours, expected)

    # In place: counts symmetric (what rank r sends j equals what j sends r).
    counts = _count_matrix(world, seed=5)
    sym = [[max(counts[i][j], counts[j][i]) for j in range(world)] for i in range(world)]
    mine = sym[rank]
    displs = [sum(mine[:j]) for j in range(world)]
    tensor = torch.cat([_payload(rank, j, mine[j], torch.float32) for j in range(world)])
    comm_api.alltoall_v_inplace(tensor, mine, displs)
    expected = torch.cat([_payload(i, rank, sym[i][rank], torch.float32) for i in range(world)])
    results["alltoall_v_inplace"] = (tensor, expected)

    # The communicator's methods take the same arguments.
    tensor = torch.cat([_payload(rank, j, mine[j], torch.float32) for j in range(world)])
    bagua.communication._get_default_group().get_global_communicator().alltoall_v_inplace(tensor, mine, displs)
    results["comm.alltoall_v_inplace"] = (tensor, expected)

    # Everything is empty: nothing moves, nothing fails.
    zeros = [0] * world
    empty = torch.empty(0)
    bagua.alltoall_v(empty, zeros, zeros, empty, zeros, zeros)

    # Rank world-1 sends rank 0 one element more than rank 0 can take: the
    # same error on every rank, and nobody hangs.
    send_counts = counts[rank][:]
    capacities = [counts[i][rank] for i in range(world)]
    if rank == world - 1:
        send_counts[0] += 1
    send, recv = torch.zeros(sum(send_counts)), torch.zeros(sum(capacities))
    results["alltoall_v/two_more_displs"] = _capture(
        bagua.alltoall_v, empty, zeros, zeros + [0, 0], empty, zeros, zeros)
    results["alltoall_v/error"] = _capture(
        bagua.alltoall_v, send, send_counts, [sum(send_counts[:j]) for j in range(world)],
        recv, capacities, [sum(capacities[:i]) for i in range(world)])


def scenario_communication(out_dir):
    """Bagua's collectives beyond the primitives, against torch.distributed."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    _alltoall_v_checks(results, rank, world)

    # gather_inplace / scatter_inplace against torch's gather / scatter.
    for root in sorted({0, world - 1}):
        count = 3
        mine = torch.arange(count, dtype=torch.float32) + 10 * rank
        if rank == root:
            tensor = torch.full((world * count,), -1.0)
            tensor[root * count:(root + 1) * count] = mine
        else:
            tensor = mine.clone()
        bagua.gather_inplace(tensor, count, root)
        gathered = [torch.empty(count) for _ in range(world)] if rank == root else None
        dist.gather(mine, gathered, dst=root)
        if rank == root:
            results[f"gather_inplace/{root}"] = (tensor, torch.cat(gathered))
        else:
            results[f"gather_inplace/{root}"] = (tensor, mine)

        full = torch.arange(world * count, dtype=torch.float32) * (root + 1)
        tensor = full.clone() if rank == root else torch.full((count,), -1.0)
        bagua.scatter_inplace(tensor, count, root)
        ref = torch.empty(count)
        dist.scatter(ref, list(full.chunk(world)) if rank == root else None, src=root)
        results[f"scatter_inplace/{root}"] = ((tensor if rank != root else tensor[root * count:(root + 1) * count]),
                                              ref)
        if rank == root:
            results[f"scatter_inplace/{root}/rest"] = (tensor, full)

    # Coalesced collectives, mixed dtypes and shapes.
    def mixed():
        g = torch.Generator().manual_seed(rank)
        return [torch.randint(0, 9, (2, 3), generator=g).float(), torch.randint(0, 9, (5,), generator=g),
                torch.randint(0, 9, (4,), generator=g).double(), torch.randint(0, 9, (1, 1), generator=g).float()]

    tensors = mixed()
    comm_api.allreduce_coalesced_inplace(tensors, op=bagua.ReduceOp.SUM)
    for i, ref in enumerate(mixed()):
        dist.all_reduce(ref)
        results[f"allreduce_coalesced_inplace/{i}"] = (tensors[i], ref)
    tensors = mixed()
    comm_api.allreduce_coalesced_inplace(tensors, op=bagua.ReduceOp.MAX)
    for i, ref in enumerate(mixed()):
        dist.all_reduce(ref, op=dist.ReduceOp.MAX)
        results[f"allreduce_coalesced_inplace/max/{i}"] = (tensors[i], ref)
    src = world - 1
    tensors = mixed()
    comm_api.broadcast_coalesced(tensors, src=src)
    for i, ref in enumerate(mixed()):
        dist.broadcast(ref, src=src)
        results[f"broadcast_coalesced/{i}"] = (tensors[i], ref)

    # broadcast_object against torch's broadcast_object_list.
    obj = {"rank": rank, "state": {"step": 3 * rank, "t": torch.arange(4) * rank}, "name": "x" * (rank + 1)}
    ours = comm_api.broadcast_object(obj, src=src)
    ref = [obj]
    dist.broadcast_object_list(ref, src=src)
    results["broadcast_object"] = (ours, ref[0])
    results["broadcast_object/none"] = (comm_api.broadcast_object(None if rank else [1, 2], 0), [1, 2])

    # The communicator object as Bagua's users call it.
    group = comm_api._get_default_group()
    comm = group.get_global_communicator()
    results["comm.rank()"] = (comm.rank(), rank)
    results["comm.rank"] = (comm.rank == rank and comm.rank + 0 == rank, True)
    results["comm.nranks()"] = (comm.nranks(), world)
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    comm.allreduce_inplace(x, 10)  # Bagua passes the op as an int: 10 is AVG
    ref = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(ref)
    results["comm.allreduce_inplace/avg"] = (x, ref / world)
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    comm.allreduce_inplace(x, bagua.ReduceOp.MAX)
    results["comm.allreduce_inplace/max"] = (x, torch.arange(6, dtype=torch.float32) * world)
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    comm.allreduce_inplace(x.ensure_bagua_tensor("x"))  # a BaguaTensor: its current value
    results["comm.allreduce_inplace/bagua_tensor"] = (x.clone(), ref)  # torch 2 pickles x's BaguaTensor

    # CommMember: WORLD is the default group; NON_COMM_MEMBER makes the calls no-ops.
    x = torch.ones(3) * rank
    bagua.allreduce_inplace(x, comm=comm_api.CommMember.WORLD)
    results["CommMember.WORLD"] = (x, torch.ones(3) * sum(range(world)))
    results["CommMember.WORLD.get_rank"] = (comm_api.CommMember.WORLD.get_rank(), rank)
    x = torch.ones(3)
    comm_api.allreduce_coalesced_inplace([x], comm=comm_api.CommMember.NON_COMM_MEMBER)
    comm_api.alltoall_v_inplace(x, [1] * world, [0] * world, comm=comm_api.CommMember.NON_COMM_MEMBER)
    results["CommMember.NON_COMM_MEMBER"] = (x, torch.ones(3))

    # get_backend: one backend per model name.
    backend = bagua.get_backend("model_a")
    results["get_backend"] = ((backend is bagua.get_backend("model_a"), backend is not bagua.get_backend("b"),
                               backend.model_name), (True, True, "model_a"))

    _save(results, rank, out_dir)


def scenario_torch_groups(out_dir):
    """from_torch_group: a torch.distributed group as a bagua group."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}

    default = comm_api.from_torch_group(None)
    x = torch.ones(2) * (rank + 1)
    bagua.allreduce_inplace(x, comm=default)
    results["default"] = (x, torch.ones(2) * sum(range(1, world + 1)))

    evens = [r for r in range(world) if r % 2 == 0]
    torch_evens = dist.new_group(evens)
    group = comm_api.from_torch_group(torch_evens)
    if rank in evens:
        x = torch.arange(3, dtype=torch.float32) + rank
        bagua.allreduce_inplace(x, comm=group)
        ref = torch.arange(3, dtype=torch.float32) + rank
        dist.all_reduce(ref, group=torch_evens)
        results["evens"] = (x, ref)
        results["evens/ranks"] = (group.ranks, evens)
    else:
        results["evens/non_member"] = (group, None)

    # Each rank passes the half it is in (torch creates both on every rank).
    half = (world + 1) // 2
    halves = [list(range(half)), list(range(half, world))]
    torch_halves = [dist.new_group(h) if h else None for h in halves]
    mine = 0 if rank < half else 1
    group = comm_api.from_torch_group(torch_halves[mine])
    x = torch.ones(4) * (rank + 1)
    bagua.allreduce_inplace(x, comm=group)
    ref = torch.ones(4) * (rank + 1)
    dist.all_reduce(ref, group=torch_halves[mine])
    results["halves"] = (x, ref)
    results["halves/ranks"] = (group.ranks, halves[mine])
    _save(results, rank, out_dir)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 23)
        self.fc2 = torch.nn.Linear(23, 9)
        self.fc3 = torch.nn.Linear(9, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class PartlyUsed(torch.nn.Module):
    """Bagua's find_unused_parameters test module: fc3 is returned, not used."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 4, bias=False)
        self.fc3 = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return F.softmax(torch.relu(self.fc2(torch.relu(self.fc1(x)))), dim=1), self.fc3


def _batches(rank, steps, features=12, classes=4, batch=8):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, features, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def _model_and_optimizer(kind, cls=Net):
    torch.manual_seed(3)
    model = cls()
    if kind == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "plain_sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(net, opt, data, sync_every=1, unpack=lambda out: out):
    """Steps the optimizer every `sync_every` batches; the batches between
    only accumulate gradients inside no_sync."""
    for i, (x, y) in enumerate(data):
        last = (i + 1) % sync_every == 0
        if last:
            F.cross_entropy(unpack(net(x)), y).backward()
            opt.step()
            opt.zero_grad()
        else:
            with net.no_sync():
                F.cross_entropy(unpack(net(x)), y).backward()
    return [p.detach().clone() for p in net.parameters()]


def scenario_ddp(out_dir):
    """data_parallel.DistributedDataParallel against torch's DDP."""
    from bagua.torch_api.data_parallel import DistributedDataParallel

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    data = _batches(rank, steps=9)
    results = {}
    for kind in ("sgd", "adam"):
        for sync_every in (1, 3):
            model, opt = _model_and_optimizer(kind)
            ref = _train(torch.nn.parallel.DistributedDataParallel(model), opt, data, sync_every)
            for view in (True, False):
                model, opt = _model_and_optimizer(kind)
                net = DistributedDataParallel(model, optimizers=[opt], algorithm=GradientAllReduceAlgorithm(),
                                              gradient_as_bucket_view=view)
                results[f"{kind}/sync_every{sync_every}/view{view}"] = (_train(net, opt, data, sync_every), ref)

    # Inside no_sync gradients stay local, as in torch's DDP (ranks differ).
    grads = []
    for make in (lambda m, o: torch.nn.parallel.DistributedDataParallel(m),
                 lambda m, o: DistributedDataParallel(m, optimizers=[o])):
        model, opt = _model_and_optimizer("sgd")
        net = make(model, opt)
        x, y = data[0]
        with net.no_sync():
            F.cross_entropy(net(x), y).backward()
        grads.append(model.fc1.weight.grad.clone())
    results["no_sync/local_grad"] = (grads[1], grads[0])

    # A torch.distributed group as process_group, the default algorithm.
    model, opt = _model_and_optimizer("sgd")
    torch_group = dist.new_group(list(range(world)))
    ref = _train(torch.nn.parallel.DistributedDataParallel(model, process_group=torch_group), opt, data)
    model, opt = _model_and_optimizer("sgd")
    net = DistributedDataParallel(model, process_group=torch_group, optimizers=[opt])
    results["torch_group"] = (_train(net, opt, data), ref)

    # The wrapper's and the engine's attributes, as Bagua's users read them.
    results["attributes"] = (
        (net.bagua_optimizers == [opt], net.inner.bagua_optimizers == [opt],
         net.inner.bagua_module_name == model._bagua_module_name, model._bagua_module_name.startswith(
             "DistributedDataParallel_V1_9_0_"), type(net.bagua_algorithm).__name__, len(net.bagua_buckets) > 0,
         all(k.startswith("module.") for k in net.state_dict()), net.require_backward_grad_sync,
         net.inner.bagua_train_step_counter, sorted(n for n, _ in net.inner.bagua_build_params())),
        (True, True, True, True, "GradientAllReduceAlgorithmImpl", True, True, True, len(data),
         sorted(n for n, _ in model.named_parameters())))

    # Parameters to ignore: bagua and torch leave them local alike.
    model, opt = _model_and_optimizer("plain_sgd")
    model._ddp_params_and_buffers_to_ignore = ["fc3.bias"]
    ref = _train(torch.nn.parallel.DistributedDataParallel(model), opt, data)
    model, opt = _model_and_optimizer("plain_sgd")
    model._ddp_params_and_buffers_to_ignore = ["fc3.bias"]
    net = DistributedDataParallel(model, optimizers=[opt])
    results["ignored"] = (_train(net, opt, data), ref)
    results["ignored/names"] = (net.parameters_to_ignore, ["fc3.bias"])
    results["ignored/build_params"] = ("fc3.bias" in dict(net.inner.bagua_build_params()), False)

    # find_unused_parameters, as Bagua's own test has it; and training with
    # an unused parameter equals torch's DDP.
    pdata = [(x[:, :2].contiguous(), y) for x, y in data]
    for find in (True, False):
        model, opt = _model_and_optimizer("plain_sgd", PartlyUsed)
        net = DistributedDataParallel(model, optimizers=[opt], find_unused_parameters=find)
        names_before = sorted(n for n, _ in net.inner.bagua_build_params())
        params = _train(net, opt, pdata, unpack=lambda out: out[0])
        results[f"find_unused/{find}/names"] = (
            (names_before, sorted(n for n, _ in net.inner.bagua_build_params())),
            (["fc1.weight", "fc2.weight", "fc3.weight"],
             ["fc1.weight", "fc2.weight"] + ([] if find else ["fc3.weight"])))
        model, opt = _model_and_optimizer("plain_sgd", PartlyUsed)
        ref = _train(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True), opt, pdata,
                     unpack=lambda out: out[0])
        results[f"find_unused/{find}/train"] = (params, ref)

    # Arguments bagua does not implement: torch's DDP, with a warning.
    model, _ = _model_and_optimizer("sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = DistributedDataParallel(model, check_reduction=True)
    results["fallback"] = ((type(fallback).__name__, any("fallback" in str(w.message) for w in caught)),
                           ("DistributedDataParallel", True))
    results["fallback/is_torch"] = (isinstance(fallback, torch.nn.parallel.DistributedDataParallel), True)
    _save(results, rank, out_dir)


def scenario_functional(out_dir):
    """data_parallel.functional.all_reduce: value and gradient."""
    from bagua.torch_api.data_parallel import functional

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    x = (torch.arange(5, dtype=torch.float64) + rank).requires_grad_()
    y = functional.all_reduce(x * (rank + 1))
    ref = (torch.arange(5, dtype=torch.float64) + rank) * (rank + 1)
    dist.all_reduce(ref)
    results["value"] = (y.detach(), ref)
    weights = torch.arange(5, dtype=torch.float64) * (rank + 2)
    (y * weights).sum().backward()
    # d/dx_r sum_q <w_q, sum_p (p+1) x_p> = (r+1) * sum_q w_q
    total = sum(torch.arange(5, dtype=torch.float64) * (q + 2) for q in range(world))
    results["grad"] = (x.grad, (rank + 1) * total)
    x2 = torch.tensor([float(rank)], requires_grad=True)
    m = functional.all_reduce(x2, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    results["max"] = (m.detach(), torch.tensor([float(world - 1)]))
    group = dist.new_group(list(range(world)))
    s = functional.all_reduce(torch.ones(2), group=group)
    results["torch_group"] = (s, torch.full((2,), float(world)))
    results["error"] = (_capture(functional.all_reduce, torch.ones(1), dist.ReduceOp.PRODUCT) is not None, True)
    _save(results, rank, out_dir)


def _bn_inputs(rank, shape_tail=(4, 3, 2)):
    """Rank `rank`'s input: its own batch size, known to every rank."""
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(3 + rank, *shape_tail, generator=g, dtype=torch.float64) * (rank + 1) + rank


def _upstream(rank, like):
    g = torch.Generator().manual_seed(90 + rank)
    return torch.randn(like.shape, generator=g, dtype=like.dtype)


def scenario_sync_bn(out_dir):
    """SyncBatchNorm against BatchNorm over every rank's inputs together
    (one process, plain torch): outputs, input/weight/bias gradients,
    running statistics over two steps, eval mode."""
    from bagua.torch_api.contrib import SyncBatchNorm

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    for momentum in (0.1, None):
        for tail in ((4, 3, 2), (4,)):
            key = f"momentum{momentum}/dims{len(tail) + 1}"
            torch.manual_seed(0)
            bn = torch.nn.BatchNorm2d(4, momentum=momentum) if len(tail) == 3 else torch.nn.BatchNorm1d(
                4, momentum=momentum)
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-1, 1)
            bn = bn.double()
            ref = __import__("copy").deepcopy(bn)
            sync = SyncBatchNorm.convert_sync_batchnorm(bn)
            for step in range(2):
                x = (_bn_inputs(rank, tail) + step).requires_grad_()
                out = sync(x)
                (out * _upstream(rank, out)).sum().backward()
                xs = [(_bn_inputs(r, tail) + step).requires_grad_() for r in range(world)]
                ref_out = ref(torch.cat(xs))
                upstream = torch.cat([_upstream(r, x) for r, x in enumerate(xs)])
                (ref_out * upstream).sum().backward()
                start = sum(3 + r for r in range(rank))
                results[f"{key}/out{step}"] = (out.detach(), ref_out[start:start + x.shape[0]].detach())
                results[f"{key}/input_grad{step}"] = (x.grad, xs[rank].grad)
            # weight/bias: each rank its own part; summed over ranks, the whole batch's
            grads = torch.cat([sync.weight.grad, sync.bias.grad])
            dist.all_reduce(grads)
            results[f"{key}/param_grads"] = (grads, torch.cat([ref.weight.grad, ref.bias.grad]))
            results[f"{key}/running"] = (torch.cat([sync.running_mean, sync.running_var]),
                                         torch.cat([ref.running_mean, ref.running_var]))
            results[f"{key}/tracked"] = (sync.num_batches_tracked, ref.num_batches_tracked)
            sync.eval()
            ref.eval()
            x = _bn_inputs(rank, tail)
            results[f"{key}/eval"] = (sync(x).detach(), ref(x).detach())
    results["converted"] = (type(sync).__name__, "SyncBatchNorm")
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    model[1].eval()
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    results["converted/nested"] = ((type(converted[1]).__name__, converted[1].training,
                                    converted[1].weight is model[1].weight), ("SyncBatchNorm", False, True))
    _save(results, rank, out_dir)


def scenario_sync_bn_ddp(out_dir):
    """A model with SyncBatchNorm trained with DistributedDataParallel equals
    one process training BatchNorm on the global batch with the loss divided
    by the world size (DDP averages the ranks' gradients)."""
    from bagua.torch_api.contrib import SyncBatchNorm
    from bagua.torch_api.data_parallel import DistributedDataParallel

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 3)).double()

    def batch(r, step):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)

    model = SyncBatchNorm.convert_sync_batchnorm(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = DistributedDataParallel(model, optimizers=[opt])
    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch(rank, step)
        F.cross_entropy(net(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
        xs, ys = zip(*[batch(r, step) for r in range(world)])
        (F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys), reduction="sum") / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    results = {"params": ([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]),
               "buffers": ([b for b in model.buffers()], [b for b in ref.buffers()])}
    _save(results, rank, out_dir)



def scenario_upstream_findings(out_dir):
    """What Bagua's own tests needed (issue 13's second round): a rank
    outside a group, resume twice, the decentralized buckets' copies, a
    second DistributedDataParallel on one module, init_bagua_communicator."""
    from bagua.torch_api.algorithms import async_model_average, decentralized
    from bagua.torch_api.data_parallel import DistributedDataParallel

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    results = {}
    # A group without the last rank: its communicator is NON_COMM_MEMBER there.
    group = bagua.communication.new_group(list(range(world - 1)))
    t = torch.full((4,), float(rank + 1))
    bagua.allreduce(t, t, comm=group.get_global_communicator())
    results["sub_allreduce"] = t.clone()
    results["non_member_marker"] = group.get_global_communicator() is comm_api.CommMember.NON_COMM_MEMBER
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=5)
    model = model.with_bagua([opt], algorithm, process_group=group)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    algorithm.resume(model)
    algorithm.resume(model)  # a second resume changes nothing
    algorithm.abort(model)
    algorithm.abort(model)
    results["async_trained"] = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.without_bagua()
    # The decentralized buckets' copies, under Bagua's names.
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], decentralized.DecentralizedAlgorithm(hierarchical=False))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    results["peer_weight"] = model.bagua_ddp.bagua_buckets[0]._peer_weight.clone()
    model.without_bagua()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False))
    bucket = model.bagua_ddp.bagua_buckets[0]
    results["low_precision_copies"] = [tuple(x.shape) for x in (bucket._weight, bucket._left_peer_weight,
                                                                 bucket._right_peer_weight)]
    model.without_bagua()
    # Two DistributedDataParallel wrappers of one module: the second replaces the first.
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    first = DistributedDataParallel(module, optimizers=[opt], algorithm=GradientAllReduceAlgorithm())
    second = DistributedDataParallel(module, optimizers=[opt], algorithm=GradientAllReduceAlgorithm())
    results["rewrap"] = _capture(lambda: [(opt.zero_grad(), second(torch.full((2, 4), float(rank))).sum().backward(),
                                           opt.step()) for _ in range(2)])
    results["rewrap_weight"] = module.weight.detach().clone()
    del first
    # Bagua 0.8's communicator of all ranks.
    communicator = comm_api.init_bagua_communicator(model_name="compat")
    data = torch.full((3,), float(rank))
    communicator.allreduce_inplace(data, bagua.ReduceOp.SUM)
    results["init_bagua_communicator"] = (communicator.nranks(), data.clone())
    _save(results, rank, out_dir)



def scenario_examples_findings(out_dir):
    """What Bagua's examples needed: the low-level API (tensors made with a
    module name mark themselves ready on get_backend(module_name)), and a
    checkpoint of a model with MoE experts restoring each rank's own."""
    import shutil
    import torch.nn as nn

    from bagua.torch_api.bucket import BaguaBucket
    from bagua.torch_api.moe import MoE

    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    backend = bagua.get_backend("low_level")
    tensors = [(torch.ones(64, 4) * (rank + 1)).ensure_bagua_tensor(name=f"t{i}", module_name="low_level")
               for i in range(3)]
    bucket = BaguaBucket(tensors, "dense", True)
    backend.register_ordered_buckets([bucket.backend_bucket])
    bucket.append_centralized_synchronous_op()
    for _ in range(2):
        for t in tensors:
            t.bagua_mark_communication_ready()
        backend.wait_pending_comm_ops()
    results["low_level"] = [t.detach().clone() for t in tensors]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.moe = MoE(32, nn.Linear(32, 32), 2, 2)
            self.fc3 = nn.Linear(32, 4)

        def forward(self, x):
            x, _, _ = self.moe(F.relu(self.fc1(x)))
            return self.fc3(x)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    torch.manual_seed(1 + rank)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,))).backward()
        opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(out_dir, "checkpoints")
    bagua.checkpoint.save_checkpoint(7, path, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    results["iteration"] = bagua.checkpoint.load_checkpoint(path, model, opt)
    results["not_restored"] = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    results["experts_differ"] = any("experts" in k for k in before)
    bagua.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    _save(results, rank, out_dir)

if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
