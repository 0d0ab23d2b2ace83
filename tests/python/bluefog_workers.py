"""Worker scenarios of test_bluefog_ops.py, run on several processes by
launcher.run_workers. Each rank records what bagua.bluefog returned (and the
errors it raised) into OUT_DIR/rank{RANK}.pt; the tests compare them with
pure-Python references of the formulas, so the workers compute nothing
they check themselves.

Usage: bluefog_workers.py SCENARIO OUT_DIR [ARGS...]
"""

import os
import sys
import time

import torch

import bagua.bluefog as bf
from bagua.bluefog import topology_util


def _save(results):
    torch.save(results, os.path.join(sys.argv[2], f"rank{bf.rank()}.pt"))


def _error(fn, *args, **kwargs):
    """The error fn raised, as (type name, is a ValueError, message); None if
    it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return type(error).__name__, isinstance(error, ValueError), str(error)
    return None


def _x(dtype=torch.float64):
    """This rank's tensor: every element equals the rank."""
    return torch.full((3, 2), float(bf.rank()), dtype=dtype)


def scenario_queries(_):
    before = _error(bf.rank)
    bf.init()
    results = _queries()
    results["before_init"] = before
    # BlueFog's tests call init in every setUp: it re-applies the topology.
    bf.init(lambda n: topology_util.RingGraph(n, 2))
    results["reinit_in"] = bf.in_neighbor_ranks()
    bf.shutdown()
    bf.shutdown()  # idempotent
    results["after_shutdown"] = (bf.is_initialized(), _error(bf.size))
    bf.init()
    results["init_again_in"] = bf.in_neighbor_ranks()
    _save(results)


def _queries():
    return {"rank": bf.rank(), "size": bf.size(), "local_rank": bf.local_rank(),
            "local_size": bf.local_size(), "machine_rank": bf.machine_rank(),
            "machine_size": bf.machine_size(), "homogeneous": bf.is_homogeneous(),
            "in": bf.in_neighbor_ranks(), "out": bf.out_neighbor_ranks(),
            "default_is_exponential": topology_util.IsTopologyEquivalent(
                bf.load_topology(), topology_util.ExponentialGraph(bf.size())),
            "local_sum": bf.allreduce(torch.tensor([float(bf.rank())]), average=False,
                                      is_hierarchical_local=True).item()}


def _static_calls(n, r, ins, outs):
    x = _x()
    out = {"default": bf.neighbor_allreduce(x),
           "sum": bf.neighbor_allreduce(x, self_weight=1.0, src_weights={j: 1.0 for j in ins}),
           "push_pull": bf.neighbor_allreduce(x, self_weight=0.5,
                                              src_weights={j: 1.0 for j in ins},
                                              dst_weights={j: 0.5 for j in outs}),
           "float32": bf.neighbor_allreduce(_x(torch.float32)),
           "float16": bf.neighbor_allreduce(_x(torch.float16)),
           "bfloat16": bf.neighbor_allreduce(_x(torch.bfloat16)),
           "tiny": bf.neighbor_allreduce(torch.full((5,), 2.0 ** -256, dtype=torch.float64)),
           "empty": bf.neighbor_allreduce(torch.empty(0, 4, dtype=torch.float64)),
           "input_untouched": None}
    if ins:  # partial: only the first in-neighbour is combined, the others are dropped
        out["partial"] = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={ins[0]: 0.5})
    if n > 1:  # "move": not edges of the static graph in general
        out["move"] = bf.neighbor_allreduce(x, self_weight=0.0, src_weights={(r - 1) % n: 1.0},
                                            dst_weights=[(r + 1) % n])
    out["input_untouched"] = bool((x == r).all())
    return out


def scenario_static(_):
    bf.init()
    n, r = bf.size(), bf.rank()
    results = _static_calls(n, r, bf.in_neighbor_ranks(), bf.out_neighbor_ranks())
    results["in"], results["out"] = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    _save(results)


def _weighted_graphs(n):
    graphs = {f"star{c}": topology_util.StarGraph(n, c) for c in range(n)}
    graphs.update({f"ring{s}": topology_util.RingGraph(n, s) for s in range(3)})
    graphs["mesh"] = topology_util.MeshGrid2DGraph(n)
    graphs["exp3"] = topology_util.ExponentialGraph(n, 3)
    return graphs


def scenario_weighted(_):
    bf.init()
    x = torch.arange(4, dtype=torch.float64) + 10.0 * bf.rank()
    results = {"x": x}
    for name, graph in _weighted_graphs(bf.size()).items():
        assert bf.set_topology(graph, is_weighted=True)
        results[name] = bf.neighbor_allreduce(x)
        results[name + ".unweighted"] = None
        assert bf.set_topology(graph, is_weighted=False)
        results[name + ".unweighted"] = bf.neighbor_allreduce(x)
    _save(results)


def scenario_dynamic(_):
    bf.init()
    r = bf.rank()
    gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), r)
    x, steps = _x(), []
    for _step in range(4):
        send, recv = next(gen)
        w = 1.0 / (len(recv) + 1)
        x = bf.neighbor_allreduce(x, self_weight=w, src_weights={j: w for j in recv},
                                  dst_weights=send, enable_topo_check=True)
        steps.append((send, recv, x.clone()))
    _save({"steps": steps})


def scenario_allgather(_):
    bf.init()
    n, r = bf.size(), bf.rank()
    rows = torch.full((r + 1, 2), float(r))  # first dimension differs per rank
    results = {"neighbors": bf.neighbor_allgather(rows), "in": bf.in_neighbor_ranks(),
               "ints": bf.neighbor_allgather(torch.tensor([r, r * 10], dtype=torch.int64))}
    if n > 1:
        src = [(r - 1) % n, (r + 1) % n] if n > 2 else [(r + 1) % n]
        results["src"] = src
        results["dynamic"] = bf.neighbor_allgather(rows, src_ranks=src, dst_ranks=src)
    results["allgather"] = bf.allgather(rows)
    # dtypes the engine does not compute in are moved as bytes.
    small = torch.full((r + 1, 3), r - 2, dtype=torch.int8)
    results["int8_neighbors"] = bf.neighbor_allgather(small)
    results["int16_allgather"] = bf.allgather(torch.full((2,), 300 * r, dtype=torch.int16))
    results["bool_bcast"] = bf.broadcast(torch.tensor([[r % 2 == 0, True]]), root_rank=n - 1)
    _save(results)


def scenario_collectives(_):
    bf.init()
    n, r = bf.size(), bf.rank()
    x = torch.arange(3, dtype=torch.float64) + r
    results = {"avg": bf.allreduce(x), "sum": bf.allreduce(x, average=False),
               "int_sum": bf.allreduce(torch.tensor([r], dtype=torch.int32), average=False),
               "bcast": bf.broadcast(x, root_rank=n - 1), "x_after": x.clone()}
    y = x.clone()
    bf.allreduce_(y)
    results["inplace"] = y
    handles = [bf.neighbor_allreduce_nonblocking(x * k, name=f"nb{k}") for k in range(6)]
    handles += [bf.allreduce_nonblocking(x * k) for k in range(3)]
    results["polled"] = all(isinstance(bf.poll(h), bool) for h in handles)
    results["nonblocking"] = [bf.synchronize(h) for h in handles]
    results["unknown_handle"] = _error(bf.synchronize, handles[0])
    torch.manual_seed(r)
    model = torch.nn.Linear(3, 2).double()
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    results["params"] = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    if r == 0:
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
        opt.step()
    bf.broadcast_optimizer_state(opt, root_rank=0)
    results["lr"] = opt.param_groups[0]["lr"]
    results["exp_avg"] = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    results["infer_src"] = topology_util.InferSourceFromDestinationRanks(
        bf.out_neighbor_ranks(), construct_adjacency_matrix=True)
    results["infer_dst"] = topology_util.InferDestinationFromSourceRanks(bf.in_neighbor_ranks())
    bf.barrier()
    _save(results)


def scenario_gossip(_):
    bf.init()
    n, r = bf.size(), bf.rank()
    partner = r ^ 1
    results = {"partner": partner if partner < n else None}
    if partner < n:
        results["average"] = bf.pair_gossip(_x(), partner)
        results["weighted"] = bf.pair_gossip(_x(), partner, self_weight=0.25, pair_weight=0.75)
    else:  # odd world: the last rank sits out, but the calls are collective
        for _ in range(2):
            results["alone"] = bf.neighbor_allreduce(_x(), self_weight=1.0, src_weights={},
                                                     dst_weights=[])
    results["half_args"] = _error(bf.pair_gossip, _x(), partner, self_weight=0.5)
    _save(results)


def scenario_hierarchical(_):
    bf.init()
    local, m, machines = bf.local_size(), bf.machine_rank(), bf.machine_size()
    # Machine m's average of these is exactly m (up to rounding).
    x = torch.full((3,), (bf.rank() - (local - 1) / 2) / local, dtype=torch.float64)
    results = {"no_machine_topology": _error(bf.hierarchical_neighbor_allreduce, x)}
    assert bf.set_machine_topology(topology_util.RingGraph(machines))
    results["in_machines"] = bf.in_neighbor_machine_ranks()
    results["default"] = bf.hierarchical_neighbor_allreduce(x)
    results["move"] = bf.hierarchical_neighbor_allreduce(
        x, self_weight=0.0, src_machine_weights={(m + 1) % machines: 0.5},
        dst_machine_weights={(m - 1) % machines: 2.0})
    results["not_a_neighbour"] = _error(bf.hierarchical_neighbor_allreduce, x, self_weight=0.5,
                                        src_machine_weights={m: 0.5}, dst_machine_weights=[])
    # Machines that pass different graphs: False everywhere, the ring is kept.
    other = topology_util.FullyConnectedGraph(machines) if bf.rank() == 0 else topology_util.RingGraph(machines)
    results["set_different"] = bf.set_machine_topology(other, is_weighted=bf.rank() == 0)
    results["kept_ring"] = topology_util.IsTopologyEquivalent(bf.load_machine_topology(),
                                                              topology_util.RingGraph(machines))
    assert bf.set_machine_topology(topology_util.StarGraph(machines, machines - 1),
                                   is_weighted=True)
    results["star"] = bf.hierarchical_neighbor_allreduce(x)
    results["x_untouched"] = bool((x == (bf.rank() - (local - 1) / 2) / local).all())
    _save(results)


def scenario_consensus(_):
    """docs/bluefog.md's two loops, as written there."""
    bf.init()
    bf.set_topology(topology_util.ExponentialGraph(bf.size()))
    x = torch.Tensor([bf.rank()])
    for _ in range(100):
        x = bf.neighbor_allreduce(x)
    static = x
    x = torch.Tensor([bf.rank()])
    gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    for _ in range(100):
        send, recv = next(gen)
        w = 1.0 / (len(recv) + 1)
        x = bf.neighbor_allreduce(x, self_weight=w, src_weights={r: w for r in recv},
                                  dst_weights=send)
    _save({"static": static, "dynamic": x})


def _linear_problem():
    """BlueFog's optimizer test problem: Y = X A + E, A fixed (16 x 3),
    E ~ N(0, 1e-5^2), 1024 training and 128 test samples per rank."""
    import numpy as np
    a = np.random.default_rng(0).standard_normal((16, 3))
    rng = np.random.default_rng(1000 + bf.rank())

    def samples(count):
        x = rng.standard_normal((count, 16))
        y = x @ a + rng.standard_normal((count, 3)) * 1e-5
        return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    return samples(1024), samples(128)


def pytest_warns(category):
    """Asserts that the block warns with ``category`` (pytest is not imported
    by the workers)."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def check():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        assert any(issubclass(w.category, category) for w in caught), caught
    return check()


def _mse(model, data):
    x, y = data
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y)
    model.train()
    return bf.allreduce(loss).item()


def _train(kind, comm, mini_batch):
    """Last three epochs' train and test MSE of one optimizer configuration."""
    train, test = _linear_problem()
    torch.manual_seed(bf.rank())  # different starts: broadcast_parameters must align them
    model = torch.nn.Linear(16, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * bf.size())
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    bf.broadcast_optimizer_state(opt, root_rank=0)
    steps = 128 // mini_batch
    if kind == "gradient":
        opt = bf.DistributedGradientAllreduceOptimizer(opt, model=model,
                                                       num_steps_per_communication=steps)
    elif kind == "deprecated":
        assert comm == "hierarchical_neighbor_allreduce"
        with pytest_warns(PendingDeprecationWarning):
            opt = bf.DistributedHierarchicalNeighborAllreduceOptimizer(
                opt, model=model, num_steps_per_communication=steps)
    else:
        wrap = (bf.DistributedAdaptThenCombineOptimizer if kind == "atc"
                else bf.DistributedAdaptWithCombineOptimizer)
        kind_of = bf.CommunicationType.neighbor_allreduce if comm == "dynamic" else \
            bf.CommunicationType[comm]
        opt = wrap(opt, model=model, communication_type=kind_of, num_steps_per_communication=steps)
    if comm == "hierarchical_neighbor_allreduce":
        bf.set_machine_topology(topology_util.RingGraph(bf.machine_size()))
    assert isinstance(opt, torch.optim.Adam)
    gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    history = []
    for _epoch in range(50):
        for start in range(0, 1024, 128):
            if comm == "dynamic":
                send, recv = next(gen)
                opt.dst_weights = send
                opt.src_weights = {r: 1 / (len(recv) + 1) for r in recv}
                opt.self_weight = 1 / (len(recv) + 1)
            opt.zero_grad()
            for i in range(start, start + 128, mini_batch):
                loss = torch.nn.functional.mse_loss(model(train[0][i:i + mini_batch]),
                                                    train[1][i:i + mini_batch])
                (loss / steps).backward()
            opt.step()
        history.append((_mse(model, train), _mse(model, test)))
    return history[-3:]


def scenario_optimizers(_, *configs):
    """configs: KIND:COMM:MINI_BATCH, e.g. awc:neighbor_allreduce:128."""
    bf.init()
    results = {}
    for config in configs:
        kind, comm, mini = config.split(":")
        results[config] = _train(kind, comm, int(mini))
    _save(results)


def scenario_optimizer_formulas(_):
    """One step of each optimizer with SGD (lr 0.1) from x_r = r on a loss
    whose gradient is c_r = r + 1 everywhere."""
    import warnings
    bf.init()
    r = bf.rank()
    results = {}
    for kind in ("awc", "atc", "gradient", "awc_allreduce"):
        model = torch.nn.Linear(2, 1, bias=False).double()
        with torch.no_grad():
            model.weight.fill_(float(r))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "gradient":
            opt = bf.DistributedGradientAllreduceOptimizer(sgd, model=model)
        elif kind == "awc_allreduce":
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd, model=model, communication_type=bf.CommunicationType.allreduce)
        else:
            wrap = (bf.DistributedAdaptThenCombineOptimizer if kind == "atc"
                    else bf.DistributedAdaptWithCombineOptimizer)
            opt = wrap(sgd, model=model)
        opt.zero_grad()
        # d/dw of sum(w) * (r + 1), through a forward pass of the model.
        (model(torch.ones(1, 2, dtype=torch.float64)).sum() * (r + 1)).backward()
        # Gradient allreduce puts each gradient in a bucket during backward.
        results[kind + ".in_flight_before_step"] = len(getattr(opt, "_sent", ()))
        opt.step()
        results[kind] = model.weight.detach().clone()
        results[kind + ".is_sgd"] = isinstance(opt, torch.optim.SGD)
        opt.unregister_hooks()
    # Two passes for num_steps_per_communication=1: BlueFog's warning.
    model = torch.nn.Linear(2, 1)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))
    results["warned"] = any("Unexpected behavior" in str(w.message) for w in caught)
    opt.step()
    results["bad_model"] = _error(bf.DistributedAdaptWithCombineOptimizer,
                                  torch.optim.SGD(model.parameters(), lr=0.1),
                                  model=torch.nn.Linear(2, 1))
    _save(results)


def scenario_atc_overlap_matches_reference(_):
    """ATC (allreduce combination, Adam) on a 4-tensor model for 3 steps
    against the same model trained by plain Adam steps each followed by an
    explicit bf.allreduce of every parameter. Saves both models' parameters."""
    bf.init()
    r = bf.rank()

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                   torch.nn.Linear(3, 2)).double()
    model, reference = build(), build()
    opt = bf.DistributedAdaptThenCombineOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.05), model=model,
        communication_type=bf.CommunicationType.allreduce)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) / 8 + r
    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            (m(x) ** 2).sum().backward()
            o.step()
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(bf.allreduce(p.detach(), average=True))
    _save({"atc": [p.detach().clone() for p in model.parameters()],
           "reference": [p.detach().clone() for p in reference.parameters()]})


def scenario_gradient_buckets(_):
    """One step of DistributedGradientAllreduceOptimizer on a 4-tensor model
    with the fusion threshold at its default (one bucket), 40 bytes (several
    buckets) and 0 (one allreduce per gradient). Rank r's loss is (r + 1)
    times rank 0's, so the average gradient is mean(r + 1) times rank 0's.
    Saves the weights after the step and the number of buckets sent."""
    bf.init()
    r = bf.rank()
    results = {}
    for threshold in (8 << 20, 40, 0):
        bf._state.state().worker.set_threshold(threshold).result()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 2)).double()
        opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                       model=model)
        opt.zero_grad()
        (model(torch.ones(1, 4, dtype=torch.float64)).sum() * (r + 1)).backward()
        buckets = len(opt._buckets) + (1 if opt._open else 0)
        opt.step()
        results[threshold] = ([p.detach().clone() for p in model.parameters()], buckets)
        opt.unregister_hooks()
    # Horovod's clipping pattern: synchronize(), then step() under
    # skip_synchronize() (at the 40-byte threshold: some buckets already sent).
    bf._state.state().worker.set_threshold(40).result()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   model=model)
    opt.zero_grad()
    (model(torch.ones(1, 4, dtype=torch.float64)).sum() * (r + 1)).backward()
    opt.synchronize()
    results["synchronized_grads"] = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    results["skip_synchronize"] = [p.detach().clone() for p in model.parameters()]
    _save(results)


def _in_flight_call(k, x, n, r, ins, outs):
    """The k-th of the calls kept in flight: static, partial, dynamic "move",
    push-pull with dst weights, or an allgather, in turn."""
    y = x * (k + 1)
    kind = k % 5
    if kind == 0:
        return bf.neighbor_allreduce_nonblocking(y, name=f"c{k}")
    if kind == 1:
        return bf.neighbor_allreduce_nonblocking(y, self_weight=0.25,
                                                 src_weights={j: 0.75 for j in ins[:1]})
    if kind == 2:
        return bf.neighbor_allreduce_nonblocking(y, self_weight=0.0,
                                                 src_weights={(r - 1) % n: 1.0},
                                                 dst_weights=[(r + 1) % n])
    if kind == 3:
        return bf.neighbor_allreduce_nonblocking(y, self_weight=0.5,
                                                 src_weights={j: 1.0 for j in ins},
                                                 dst_weights={j: 0.5 for j in outs})
    return bf.neighbor_allgather_nonblocking(y)


def scenario_in_flight(_):
    """50 nonblocking calls in flight at once, synchronized in reverse."""
    bf.init()
    n, r = bf.size(), bf.rank()
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    x = _x()
    handles = [_in_flight_call(k, x, n, r, ins, outs) for k in range(50)]
    results = {k: bf.synchronize(handles[k]) for k in reversed(range(50))}
    _save({"results": results})


# -- fusion of nonblocking neighbour allreduces ----------------------------------------
_FUSION_KINDS = ["default", "sum", "move", "push_pull", "partial"]
_FUSION_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_FUSION_SHAPES = [(3, 2), (7,), (0, 4), (5, 3), (1,), (2, 2, 3)]


def _fusion_plan(n):
    """50 calls as runs of one kind (1 to 8 long) in which the dtype changes
    now and then; the same on every rank (one seed). "move" needs a peer."""
    rng = torch.Generator().manual_seed(7)
    kinds = _FUSION_KINDS if n > 1 else [k for k in _FUSION_KINDS if k != "move"]
    plan = []
    while len(plan) < 50:
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=rng))]
        dtype = _FUSION_DTYPES[int(torch.randint(4, (1,), generator=rng))]
        for _ in range(int(torch.randint(1, 9, (1,), generator=rng))):
            if float(torch.rand(1, generator=rng)) < 0.2:
                dtype = _FUSION_DTYPES[int(torch.randint(4, (1,), generator=rng))]
            shape = _FUSION_SHAPES[int(torch.randint(len(_FUSION_SHAPES), (1,), generator=rng))]
            plan.append((kind, dtype, shape))
    return plan[:50]


def _fusion_input(k, r, dtype, shape):
    """x_r of call k: r plus a fractional pattern shared by the ranks (so
    results need rounding and bit equality means something)."""
    numel = 1
    for d in shape:
        numel *= d
    base = (torch.arange(numel, dtype=torch.float64) * 0.37 + k / 7).reshape(shape)
    return (base + r).to(dtype)


def _fusion_call(kind, x, n, r, ins, outs, nonblocking):
    op = bf.neighbor_allreduce_nonblocking if nonblocking else bf.neighbor_allreduce
    if kind == "default":
        return op(x)
    if kind == "sum":
        return op(x, self_weight=1.0, src_weights={j: 1.0 for j in ins})
    if kind == "move":
        return op(x, self_weight=0.0, src_weights={(r - 1) % n: 1.0}, dst_weights=[(r + 1) % n])
    if kind == "push_pull":
        return op(x, self_weight=0.5, src_weights={j: 1.0 for j in ins},
                  dst_weights={j: 0.5 for j in outs})
    return op(x, self_weight=0.25, src_weights={j: 0.75 for j in ins[:1]})  # partial


def scenario_fusion_mixed(_):
    """The plan's 50 calls in flight (synchronized in reverse), then the same
    calls made blocking (each runs alone), with the worker's counters."""
    from bagua.bluefog._state import state
    bf.init()
    n, r = bf.size(), bf.rank()
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    plan = _fusion_plan(n)
    xs = [_fusion_input(k, r, dtype, shape) for k, (_, dtype, shape) in enumerate(plan)]
    copies = [x.clone() for x in xs]
    before = state().worker.stats()
    handles = [_fusion_call(kind, x, n, r, ins, outs, True) for (kind, _, _), x in zip(plan, xs)]
    fused = {k: bf.synchronize(handles[k]) for k in reversed(range(50))}
    after_fused = state().worker.stats()
    blocking = [_fusion_call(kind, x, n, r, ins, outs, False) for (kind, _, _), x in zip(plan, xs)]
    after_blocking = state().worker.stats()
    _save({"plan": plan, "fused": [fused[k] for k in range(50)], "blocking": blocking,
           "untouched": all(torch.equal(x, c) for x, c in zip(xs, copies)),
           "stats": (before, after_fused, after_blocking), "ins": ins})


def _in_flight(tensors, **kwargs):
    """Nonblocking neighbour allreduces of ``tensors``, all in flight, then
    their results (or errors) in order."""
    handles = [bf.neighbor_allreduce_nonblocking(t, **kwargs) for t in tensors]
    return [_result(h) for h in handles]


def _result(handle):
    """The handle's result, or the error it raised as _error() describes it."""
    try:
        return bf.synchronize(handle)
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return type(error).__name__, isinstance(error, ValueError), str(error)


def scenario_fusion_counts(_):
    """Run with BLUEFOG_FUSION_THRESHOLD=800 and a long cycle time: what the
    worker fused, call by call, and errors landing on their own handles."""
    from bagua.bluefog._state import state
    bf.init()
    r = bf.rank()
    stats = [state().worker.stats()]
    results = {"f64": _in_flight([torch.full((10,), float(r + k), dtype=torch.float64) for k in range(30)])}
    stats.append(state().worker.stats())
    results["f32"] = _in_flight([torch.full((10,), float(r + k)) for k in range(50)])
    stats.append(state().worker.stats())
    results["large"] = _in_flight([torch.full((300,), float(r), dtype=torch.float64)])
    stats.append(state().worker.stats())
    # An integer tensor and a size that differs between ranks, amid calls of
    # the same pattern: each fails on its own handle, the others are right.
    results["bad"] = _in_flight([torch.full((4,), float(r + 1)).double(),
                                 torch.full((4,), float(r + 2)).double(),
                                 torch.zeros(4, dtype=torch.int64),
                                 torch.full((4,), float(r + 3)).double(),
                                 torch.zeros(r + 1, dtype=torch.float64),
                                 torch.full((4,), float(r + 4)).double()])
    stats.append(state().worker.stats())
    results["stats"] = stats
    results["ins"] = bf.in_neighbor_ranks()
    _save(results)


def scenario_timeline(_):
    import json
    from bagua.bluefog import _timeline
    bf.init()
    x = _x()
    results = {"started": bf.timeline_start_activity("x", "COMPUTE"),
               "started_twice": bf.timeline_start_activity("x", "COMPUTE")}
    results["ended"] = bf.timeline_end_activity("x")
    results["ended_twice"] = bf.timeline_end_activity("x")
    with bf.timeline_context("y", "UPDATE"):
        bf.neighbor_allreduce(x, name="w")
    bf.allreduce(x, name="a")
    path = _timeline.write()
    results["names"] = sorted(e["name"] for e in json.loads(path.read_text())["traceEvents"]
                              if e.get("cat") == "bluefog") if path else None
    _save(results)


def scenario_mismatch(_):
    """Mismatched patterns with the check on: ValueError on every rank,
    nothing sent, and the next calls still work."""
    bf.init()
    n, r = bf.size(), bf.rank()
    x = _x()
    # A ring pass in which rank 0 sends nothing: rank 1 waits for it.
    dst = [] if r == 0 else [(r + 1) % n]
    results = {"bad_dynamic": _error(bf.neighbor_allreduce, x, self_weight=0.5,
                                     src_weights={(r - 1) % n: 0.5}, dst_weights=dst)}
    # Ranks pass different sizes.
    results["bad_size"] = _error(bf.neighbor_allreduce, torch.zeros(r + 1, dtype=torch.float64))
    # Argument errors, raised before anything is sent.
    results["args"] = {
        "self_only": _error(bf.neighbor_allreduce, x, self_weight=0.5),
        "src_only": _error(bf.neighbor_allreduce, x, src_weights={}),
        "dst_alone": _error(bf.neighbor_allreduce, x, dst_weights=[]),
        "not_in": _error(bf.neighbor_allreduce, x, self_weight=0.5, src_weights={r: 0.5}),
        "duplicate": _error(bf.neighbor_allreduce, x, self_weight=0.5, src_weights={},
                            dst_weights=[(r + 1) % n] * 2),
        "integer": _error(bf.neighbor_allreduce, torch.zeros(2, dtype=torch.int64)),
        "renamed": _error(bf.neighbor_allreduce, x, neighbor_weights={}),
        "allgather_half": _error(bf.neighbor_allgather, x, src_ranks=[]),
    }
    results["after"] = bf.neighbor_allreduce(x)
    # Different graphs per rank: every rank gets False and keeps its topology.
    graph = (topology_util.FullyConnectedGraph(n) if r % 2 == 0 else
             topology_util.nx.from_numpy_array(topology_util.np.eye(n),
                                               create_using=topology_util.nx.DiGraph))
    results["set_different"] = bf.set_topology(graph)
    results["kept_exponential"] = topology_util.IsTopologyEquivalent(
        bf.load_topology(), topology_util.ExponentialGraph(n))
    results["set_same"] = bf.set_topology(topology_util.RingGraph(n))
    results["set_again"] = bf.set_topology(topology_util.RingGraph(n))
    results["not_a_graph"] = _error(bf.set_topology, "ring") if r == 0 else bf.set_topology(
        topology_util.RingGraph(n))
    results["after_set"] = bf.neighbor_allreduce(x)
    _save(results)


def scenario_unchecked_mismatch(_):
    """Mismatched pattern with the check off: the ranks involved fail within
    the timeout (BAGUA_COMM_TIMEOUT_S), never hang; the others return."""
    bf.init()
    n, r = bf.size(), bf.rank()
    x = _x()
    # Rank 0 also expects a message from rank 2, which sends none.
    src = {(r - 1) % n: 0.5} if r != 0 else {n - 1: 0.25, 2: 0.25}
    start = time.monotonic()
    error = _error(bf.neighbor_allreduce, x, self_weight=0.5, src_weights=src,
                   dst_weights=[(r + 1) % n], enable_topo_check=False)
    _save({"error": error, "seconds": time.monotonic() - start})
    # Stay connected past the timeout, so rank 0 waits for a message that
    # never comes rather than seeing its peers' connections close.
    time.sleep(float(os.environ["BAGUA_COMM_TIMEOUT_S"]) + 4)
    os._exit(0)  # this rank's neighbour communicator is out of step now: skip the exit handlers


def scenario_unchecked_mismatch_then_rebuild(_):
    """The mismatch above; then a matched call, which fails on every rank
    (rank 0's connections were closed by its timeout); then bf.shutdown()
    and bf.init() on every rank, after which matched calls work again."""
    bf.init()
    n, r = bf.size(), bf.rank()
    x = _x()
    src = {(r - 1) % n: 0.5} if r != 0 else {n - 1: 0.25, 2: 0.25}
    ring = dict(self_weight=0.5, src_weights={(r - 1) % n: 0.5}, dst_weights=[(r + 1) % n])
    mismatch = _error(bf.neighbor_allreduce, x, self_weight=0.5, src_weights=src,
                      dst_weights=[(r + 1) % n], enable_topo_check=False)
    errors = [_error(bf.neighbor_allreduce, x, **ring) for _ in range(2)]
    bf.shutdown()
    bf.init()
    rebuilt = [bf.neighbor_allreduce(x, **ring, enable_topo_check=check) for check in (True, False)]
    _save({"mismatch": mismatch, "errors": errors, "rebuilt": rebuilt})


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2], *sys.argv[3:])
