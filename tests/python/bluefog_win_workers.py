"""Worker scenarios of test_bluefog_windows.py, run on several processes by
launcher.run_workers. Each rank records what bagua.bluefog's window calls
returned (and the errors they raised) into OUT_DIR/rank{RANK}.pt; the tests
compare them with pure-Python references, so the workers check nothing
themselves.

Usage: bluefog_win_workers.py SCENARIO OUT_DIR [ARGS...]
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
    """(type name, is a ValueError, message) of what fn raised; None if it
    returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return type(error).__name__, isinstance(error, ValueError), str(error)
    return None


def _buffers(name):
    """Each in-neighbour's buffer, read through the public API: an update
    with weight 1 on that buffer alone, into a clone (it zeroes the
    versions, as every update does)."""
    return {j: bf.win_update(name, 0.0, {j: 1.0}, clone=True).clone()
            for j in bf.in_neighbor_ranks()}


def _init(topology):
    bf.init()
    n = bf.size()
    graph = {"exp": topology_util.ExponentialGraph, "ring": topology_util.RingGraph}[topology](n)
    assert bf.set_topology(graph)


def scenario_basic(_, topology):
    """Every call of the window table on value = rank, in phases separated by
    barriers so each phase's closed form is exact."""
    _init(topology)
    r, out = bf.rank(), {}
    x = torch.full((5, 3), float(r), dtype=torch.float64)
    out["in"], out["out"] = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    out["create"] = bf.win_create(x, "w")
    out["create_again"] = bf.win_create(torch.zeros(2), "w")  # duplicate name
    out["zero_create"] = bf.win_create(torch.ones(4, dtype=torch.float32), "z", zero_init=True)
    out["names"] = bf.get_current_created_window_names()
    out["initial"] = _buffers("w")
    out["zero_initial"] = _buffers("z")
    out["version0"] = bf.get_win_version("w")
    bf.barrier()

    # put: weight 1 to every out-neighbour; then dst_weights 2 and self_weight 0.5.
    out["put_returns"] = bf.win_put(x, "w")
    bf.barrier()
    out["version_put"], out["after_put"] = bf.get_win_version("w"), _buffers("w")
    bf.barrier()
    bf.neighbor_win_put(x, "w", self_weight=0.5, dst_weights={d: 2.0 for d in bf.out_neighbor_ranks()})
    out["x_after_self_weight"] = x.clone()  # 0.5 r
    bf.barrier()
    out["version_put2"], out["after_put2"] = bf.get_win_version("w"), _buffers("w")
    bf.barrier()

    # accumulate (nonblocking): += 1 * x (0.5 r); versions unchanged.
    handle = bf.win_accumulate_nonblocking(x, "w")
    out["poll_type"] = type(bf.win_poll(handle)).__name__
    out["wait"] = bf.win_wait(handle)
    bf.barrier()
    out["version_acc"], out["after_acc"] = bf.get_win_version("w"), _buffers("w")
    bf.barrier()

    # get: weight 3 from the first in-neighbour, default weights from all.
    ins = bf.in_neighbor_ranks()
    if ins:
        bf.win_get("w", src_weights={ins[0]: 3.0})
        out["after_get_one"] = _buffers("w")
    handle = bf.win_get_nonblocking("w")
    bf.win_wait(handle)
    out["version_get"], out["after_get"] = bf.get_win_version("w"), _buffers("w")
    bf.barrier()  # every get read x (0.5 r) before anyone updates

    # update: default (uniform average), then weights and reset, then collect.
    out["update_default"] = bf.win_update("w").clone()  # buffers hold 0.5 j
    out["update_is_registered"] = bf.win_update("w", clone=False) is x
    out["version_update"] = bf.get_win_version("w")
    bf.barrier()
    bf.win_put(x, "w")  # buffers := x_j
    bf.barrier()
    out["x_before_weighted"] = x.clone()
    if ins:
        out["update_weighted"] = bf.win_update(
            "w", self_weight=0.25, neighbor_weights={ins[-1]: 0.75}, reset=True).clone()
        out["after_reset"] = _buffers("w")
    bf.barrier()
    bf.win_accumulate(x, "w", dst_weights={d: 1.0 for d in bf.out_neighbor_ranks()})
    bf.barrier()
    out["x_before_collect"] = x.clone()
    out["collect"] = bf.win_update_then_collect("w").clone()
    out["after_collect"] = _buffers("w")
    bf.barrier()

    # Errors: each on this rank alone, before anything is sent.
    n = bf.size()
    strangers = [s for s in range(n) if s not in bf.out_neighbor_ranks()]
    out["err_put_stranger"] = _error(bf.win_put, x, "w", dst_weights={strangers[0]: 1.0})
    ins_not = [s for s in range(n) if s not in bf.in_neighbor_ranks()]
    out["err_get_stranger"] = _error(bf.win_get, "w", src_weights={ins_not[0]: 1.0})
    out["err_missing"] = _error(bf.win_put, x, "nowhere")
    out["err_missing_update"] = _error(bf.win_update, "nowhere")
    out["err_one_weight"] = _error(bf.win_update, "w", self_weight=0.5)
    out["err_update_stranger"] = _error(bf.win_update, "w", 0.5, {ins_not[0]: 0.5})
    out["err_wrong_tensor"] = _error(bf.win_put, torch.zeros(3), "w")
    out["err_dtype"] = _error(bf.win_create, torch.zeros(3, dtype=torch.int64), "ints")
    out["err_wait"] = _error(bf.win_wait, 12345)
    out["names_before_free"] = bf.get_current_created_window_names()
    out["free_w"] = bf.win_free("w")
    out["names_after_free"] = bf.get_current_created_window_names()
    out["free_missing"] = bf.win_free("w")
    out["free_all"] = bf.win_free()
    out["free_none"] = bf.win_free()
    out["names_end"] = bf.get_current_created_window_names()
    # A window of the same name can be created again.
    out["recreate"] = bf.win_create(torch.zeros(2), "w")
    bf.win_free()
    _save(out)
    bf.shutdown()


def scenario_passive(_, numel):
    """The last rank computes (sleeps) for 3 s without a call while every
    other rank puts, accumulates and gets a large tensor into / from it."""
    bf.init()
    bf.set_topology(topology_util.FullyConnectedGraph(bf.size()))
    r, n, out = bf.rank(), bf.size(), {}
    target = n - 1
    x = torch.arange(int(numel), dtype=torch.float64) + 1000.0 * r
    bf.win_create(x, "big", zero_init=True)
    y = torch.full((int(numel),), float(r + 1), dtype=torch.float32)
    bf.win_create(y, "big32")
    bf.barrier()
    if r == target:
        t0 = time.monotonic()
        time.sleep(3.0)  # no BlueFog call meanwhile
        out["slept"] = time.monotonic() - t0
    else:
        t0 = time.monotonic()
        bf.win_put(x, "big", dst_weights={target: 2.0})
        bf.win_accumulate(y, "big32", dst_weights={target: 1.0})
        bf.win_get("big", src_weights={target: 1.0})
        out["elapsed"] = time.monotonic() - t0
        out["got"] = bf.win_update("big", 0.0, {target: 1.0}, clone=True)
    bf.barrier()
    if r == target:
        out["versions"] = bf.get_win_version("big")  # before the reads below zero them
        out["buffers"] = {j: bf.win_update("big", 0.0, {j: 1.0}, clone=True)
                          for j in range(n) if j != r}
        out["buffers32"] = {j: bf.win_update("big32", 0.0, {j: 1.0}, clone=True)
                            for j in range(n) if j != r}
    bf.win_free()
    _save(out)


def scenario_everyone_at_once(_, numel, rounds):
    """Every rank, at the same time, puts to, accumulates into and gets from
    every other rank (a call reaches all its peers at once), for several
    rounds; large tensors (several chunks) and distinct weights per peer."""
    bf.init()
    bf.set_topology(topology_util.FullyConnectedGraph(bf.size()))
    r, n = bf.rank(), bf.size()
    x = torch.arange(int(numel), dtype=torch.float64) + 1000.0 * r
    bf.win_create(x, "all")
    others = [j for j in range(n) if j != r]
    out = {"put": {}, "get": {}}
    for k in range(int(rounds)):
        bf.win_put(x, "all", dst_weights={j: 1.0 + j + k for j in others})
        bf.barrier()
        out["put"][k] = _buffers("all")  # what each peer put here, weighted by this rank
        bf.barrier()
        bf.win_accumulate(x, "all", dst_weights={j: 0.5 for j in others})
        bf.barrier()  # every accumulate has landed before the gets overwrite the buffers
        bf.win_get("all", src_weights={j: 2.0 for j in others})
        out["get"][k] = _buffers("all")
        bf.barrier()
    bf.win_free()
    _save(out)


def scenario_mutex(_):
    """Rank 0 holds its own mutex for 1.2 s after a barrier; the others ask
    for it right after the barrier."""
    bf.init()
    r, out = bf.rank(), {}
    x = torch.zeros(4)
    bf.win_create(x, "m")
    if r == 0:
        with bf.win_mutex("m", for_self=True):
            bf.barrier()
            time.sleep(1.2)  # 0.2 s of margin for the barrier's skew
    else:
        bf.barrier()
        t0 = time.monotonic()
        with bf.win_mutex("m", ranks=[0]):
            out["acquire_s"] = time.monotonic() - t0
    bf.barrier()
    # Many short critical sections, require_mutex on puts and updates.
    for _ in range(5):
        bf.win_put(x, "m", require_mutex=True)
        bf.win_update("m", require_mutex=True)
        with bf.win_mutex("m"):
            pass
    bf.barrier()
    out["done"] = True
    bf.win_free()
    _save(out)


def scenario_associated_p(_):
    """On a tensor of ones, every op applies to p as to the tensor: after
    each phase p == tensor[0]."""
    bf.init()
    bf.turn_on_win_ops_with_associated_p()
    out = {"pairs": []}
    x = torch.ones(6, dtype=torch.float64)
    bf.win_create(x, "p")
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()

    def record(label):
        bf.barrier()
        out["pairs"].append((label, bf.win_associated_p("p"), x[0].item(), x.clone()))
        bf.barrier()

    record("create")
    bf.win_put(x, "p", self_weight=0.5, dst_weights={d: 0.25 * (d + 1) for d in outs})
    record("put")
    bf.win_update("p", 0.5, {j: 0.5 / max(1, len(ins)) for j in ins})
    record("update")
    bf.win_accumulate(x, "p", self_weight=0.75, dst_weights={d: 0.3 for d in outs})
    record("accumulate")
    bf.win_update_then_collect("p")
    record("collect")
    if ins:
        bf.win_get("p", src_weights={ins[0]: 0.4})
    bf.barrier()
    bf.win_update("p", 0.6, {ins[0]: 1.0} if ins else {})
    record("get_update")
    bf.win_update("p")
    record("default_update")
    bf.turn_off_win_ops_with_associated_p()
    p_before = bf.win_associated_p("p")
    bf.win_put(x, "p", self_weight=0.5)
    out["off"] = (p_before, bf.win_associated_p("p"))
    bf.barrier()
    bf.win_free()
    _save(out)


def scenario_push_sum(_, steps):
    """BlueFog's push-sum (the paper's Listing 3), asynchronous: each rank
    runs its own steps; a barrier and a final collect gather every message."""
    bf.init()
    bf.turn_on_win_ops_with_associated_p()
    r, n = bf.rank(), bf.size()
    x = torch.tensor([float(r), float(r * r), 1.0], dtype=torch.float64)
    bf.win_create(x, "ps", zero_init=True)
    outs = bf.out_neighbor_ranks()
    w = 1.0 / (len(outs) + 1)
    bf.barrier()
    for step in range(int(steps)):
        bf.win_accumulate(x, "ps", self_weight=w, dst_weights={d: w for d in outs},
                          require_mutex=True)
        bf.win_update_then_collect("ps")
        if r == step % n:
            time.sleep(0.002)  # uneven pace
    bf.barrier()
    bf.win_update_then_collect("ps")
    _save({"x": x.clone(), "p": bf.win_associated_p("ps")})
    bf.barrier()
    bf.win_free()


def scenario_dead_peer(_):
    """Rank 1 exits without a word after win_create; rank 0's put to it must
    fail within BAGUA_COMM_TIMEOUT_S, naming the rank, op and window."""
    bf.init()
    bf.set_topology(topology_util.FullyConnectedGraph(bf.size()))
    x = torch.ones(8)
    bf.win_create(x, "gone")
    bf.barrier()
    if bf.rank() == 1:
        os._exit(3)
    time.sleep(1.0)
    t0 = time.monotonic()
    error = _error(bf.win_put, x, "gone", dst_weights={1: 1.0})
    _save({"error": error, "elapsed": time.monotonic() - t0})
    os._exit(0)  # the peer is gone: no collective teardown


def scenario_missing_peer(_):
    """Rank 1 is alive but never creates the window: rank 0's win_create
    must fail within BAGUA_COMM_TIMEOUT_S, naming the op and window."""
    bf.init()
    bf.win_create(torch.ones(2), "first")  # the service runs on both
    if bf.rank() == 1:
        time.sleep(float(os.environ["BAGUA_COMM_TIMEOUT_S"]) + 0.5)
        os._exit(0)
    t0 = time.monotonic()
    error = _error(bf.win_create, torch.ones(4), "lonely")
    _save({"error": error, "elapsed": time.monotonic() - t0})
    os._exit(0)  # rank 1 never joined: no collective teardown


def scenario_win_optimizers(_, epochs, *kinds):
    """BlueFog's optimizer problem (Linear(16, 3), noise 1e-5, Adam) with
    the window optimizers; the last three epochs' train and test MSE and
    whether the windows were freed."""
    from bluefog_workers import _linear_problem, _mse
    bf.init()
    results = {}
    for kind in kinds:
        train, test = _linear_problem()
        torch.manual_seed(bf.rank())
        model = torch.nn.Linear(16, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * bf.size())
        bf.broadcast_parameters(model.state_dict(), root_rank=0)
        if kind == "winput":
            opt = bf.DistributedWinPutOptimizer(opt, model=model, window_prefix="wp")
            names = bf.get_current_created_window_names()
        elif kind == "pullget":
            opt = bf.DistributedPullGetOptimizer(opt, model=model, window_prefix="pg")
            names = bf.get_current_created_window_names()
        else:
            opt = bf.DistributedPushSumOptimizer(opt, model=model)
            names = bf.get_current_created_window_names()
        assert isinstance(opt, torch.optim.Adam)
        history = []
        for _epoch in range(int(epochs)):
            for start in range(0, 1024, 128):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(train[0][start:start + 128]),
                                                    train[1][start:start + 128])
                loss.backward()
                opt.step()
            history.append((_mse(model, train), _mse(model, test)))
        opt.unregister_window()
        results[kind] = {"mse": history[-3:], "history": history, "names": names,
                         "after": bf.get_current_created_window_names()}
    _save(results)


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](*sys.argv[2:])
