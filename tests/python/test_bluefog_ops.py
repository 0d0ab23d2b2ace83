"""bagua.bluefog's communication on 1 to 6 processes (Gloo): every result
against a pure-Python reference of design bluefog.md's formulas, and the
failure cases (mismatched patterns raise ValueError on every rank, or fail
within the timeout with the check off; never a hang)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import launcher
from bagua.bluefog import topology_util as tu

WORKERS = Path(__file__).with_name("bluefog_workers.py")
SIZES = [1, 2, 3, 4, 5, 6]


def run(scenario, n, tmp_path, **kwargs):
    return launcher.run_workers(scenario, n, tmp_path, script=WORKERS, **kwargs)


def exp_in(n, r):
    """In-neighbours of r in ExponentialGraph(n): r - 2**j (mod n), self excluded."""
    return sorted({(r - 2 ** j) % n for j in range(n) if 2 ** j < n} - {r})


def ring_in(n, r):
    return sorted({(r - 1) % n, (r + 1) % n} - {r})


def full(value, shape=(3, 2), dtype=torch.float64):
    return torch.full(shape, float(value), dtype=dtype)


@pytest.mark.parametrize("n", SIZES)
def test_static_neighbor_allreduce(n, tmp_path):
    results = run("static", n, tmp_path)
    for r, got in enumerate(results):
        ins = exp_in(n, r)
        assert got["in"] == ins and got["out"] == sorted({(r + 2 ** j) % n for j in range(n)
                                                          if 2 ** j < n} - {r})
        avg = (r + sum(ins)) / (len(ins) + 1)
        assert torch.equal(got["default"], full(avg)), f"rank {r}"
        assert torch.equal(got["sum"], full(r + sum(ins)))
        assert torch.equal(got["push_pull"], full((r + sum(ins)) / 2))
        assert got["float32"].dtype == torch.float32
        assert torch.allclose(got["float32"], full(avg, dtype=torch.float32), rtol=1e-6)
        assert got["float16"].dtype == torch.float16
        assert torch.allclose(got["float16"].double(), full(avg), atol=1e-3 * max(1, avg))
        assert torch.allclose(got["bfloat16"].double(), full(avg), rtol=1e-2)
        # Sum then divide: averaging equal values is exact.
        assert torch.equal(got["tiny"], torch.full((5,), 2.0 ** -256, dtype=torch.float64))
        assert got["empty"].shape == (0, 4)
        assert got["input_untouched"]
        if ins:
            assert torch.equal(got["partial"], full(0.5 * r + 0.5 * ins[0]))
        if n > 1:
            assert torch.equal(got["move"], full((r - 1) % n))


@pytest.mark.parametrize("n", [2, 5])
def test_fifty_calls_in_flight_each_get_their_own_result(n, tmp_path):
    results = run("in_flight", n, tmp_path)
    for r, got in enumerate(results):
        ins = exp_in(n, r)
        for k in range(50):
            s = k + 1  # call k sends x * (k + 1)
            expected = {0: full((r + sum(ins)) / (len(ins) + 1) * s),
                        1: full(0.25 * r * s + 0.75 * ins[0] * s),
                        2: full(((r - 1) % n) * s),
                        3: full((r + sum(ins)) / 2 * s),
                        4: torch.cat([full(j * s) for j in ins])}[k % 5]
            assert torch.allclose(got["results"][k], expected, rtol=1e-12), f"rank {r} call {k}"


def transposed_product(w, xs):
    """out_i = sum_u W[u, i] x_u."""
    return [sum(w[u, i] * xs[u] for u in range(len(xs))) for i in range(len(xs))]


@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_weighted_topologies(n, tmp_path):
    results = run("weighted", n, tmp_path)
    xs = [got["x"] for got in results]
    for r in range(n):
        assert torch.equal(xs[r], torch.arange(4, dtype=torch.float64) + 10.0 * r)
    graphs = {f"star{c}": tu.StarGraph(n, c) for c in range(n)}
    graphs.update({f"ring{s}": tu.RingGraph(n, s) for s in range(3)})
    graphs["mesh"] = tu.MeshGrid2DGraph(n)
    graphs["exp3"] = tu.ExponentialGraph(n, 3)
    for name, graph in graphs.items():
        w = tu.nx.to_numpy_array(graph, nodelist=range(n))
        expected = transposed_product(w, xs)
        for r, got in enumerate(results):
            assert torch.allclose(got[name], expected[r], rtol=1e-12, atol=1e-12), f"{name} rank {r}"
            ins = sorted(set(graph.predecessors(r)) - {r})
            uniform = (xs[r] + sum(xs[j] for j in ins)) / (len(ins) + 1)
            assert torch.allclose(got[name + ".unweighted"], uniform, rtol=1e-12), f"{name} {r}"
    # The star's closed form on the first element (10 r): centre (n-1)/2, others r(1-1/n) + c/n.
    for c in range(n):
        for r, got in enumerate(results):
            value = got[f"star{c}"][0].item() / 10
            expected = (n - 1) / 2 if r == c else r * (1 - 1 / n) + c / n
            assert value == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_dynamic_one_peer(n, tmp_path):
    results = run("dynamic", n, tmp_path)
    gens = [tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialGraph(n), r) for r in range(n)]
    xs = [full(r) for r in range(n)]
    for step in range(4):
        pattern = [next(g) for g in gens]
        new = []
        for r, (send, recv) in enumerate(pattern):
            w = 1.0 / (len(recv) + 1)
            new.append(w * xs[r] + sum(w * xs[j] for j in recv))
        xs = new
        for r, got in enumerate(results):
            send, recv, x = got["steps"][step]
            assert (send, recv) == pattern[r]
            assert torch.allclose(x, xs[r], rtol=1e-12), f"step {step} rank {r}"


@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_neighbor_allgather(n, tmp_path):
    results = run("allgather", n, tmp_path)
    rows = [torch.full((r + 1, 2), float(r)) for r in range(n)]
    for r, got in enumerate(results):
        ins = exp_in(n, r)
        assert got["in"] == ins
        expected = torch.cat([rows[j] for j in ins]) if ins else torch.empty(0, 2)
        assert torch.equal(got["neighbors"], expected), f"rank {r}"
        ints = [torch.tensor([j, 10 * j]) for j in ins]
        assert torch.equal(got["ints"], torch.cat(ints) if ints else torch.empty(0, dtype=torch.int64))
        if n > 1:
            assert torch.equal(got["dynamic"], torch.cat([rows[j] for j in got["src"]]))
        assert torch.equal(got["allgather"], torch.cat(rows))
        small = [torch.full((j + 1, 3), j - 2, dtype=torch.int8) for j in ins]
        assert torch.equal(got["int8_neighbors"],
                           torch.cat(small) if small else torch.empty(0, 3, dtype=torch.int8))
        assert torch.equal(got["int16_allgather"],
                           torch.cat([torch.full((2,), 300 * j, dtype=torch.int16) for j in range(n)]))
        assert torch.equal(got["bool_bcast"], torch.tensor([[(n - 1) % 2 == 0, True]]))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_collectives_handles_and_broadcasts(n, tmp_path):
    results = run("collectives", n, tmp_path)
    base = torch.arange(3, dtype=torch.float64)
    for r, got in enumerate(results):
        x = base + r
        assert torch.equal(got["avg"], base + (n - 1) / 2)
        assert torch.equal(got["sum"], n * base + n * (n - 1) / 2)
        assert got["int_sum"].dtype == torch.int32 and got["int_sum"].item() == n * (n - 1) // 2
        assert torch.equal(got["bcast"], base + n - 1)
        assert torch.equal(got["x_after"], x)
        assert torch.equal(got["inplace"], base + (n - 1) / 2)
        ins = exp_in(n, r)
        neighbour = (x + sum(base + j for j in ins)) / (len(ins) + 1)
        expected = [neighbour * k for k in range(6)] + [(base + (n - 1) / 2) * k for k in range(3)]
        assert got["polled"]
        for k, (ours, ref) in enumerate(zip(got["nonblocking"], expected)):
            assert torch.allclose(ours, ref, rtol=1e-12), f"rank {r} call {k}"
        name, is_value_error, _ = got["unknown_handle"]
        assert is_value_error
        for ours, root in zip(got["params"], results[0]["params"]):
            assert torch.equal(ours, root)
        assert got["lr"] == pytest.approx(0.1)
        for ours, root in zip(got["exp_avg"], results[0]["exp_avg"]):
            assert torch.equal(ours, root) and root.abs().sum() > 0
        sources, w = got["infer_src"]
        assert sources == ins
        a = np.eye(n)
        for k in range(n):
            a[k, sorted({(k + 2 ** j) % n for j in range(n) if 2 ** j < n} - {k})] = 1
        np.testing.assert_array_equal(w, a / a.sum(axis=1))
        assert got["infer_dst"] == sorted({(r + 2 ** j) % n for j in range(n) if 2 ** j < n} - {r})


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_pair_gossip(n, tmp_path):
    results = run("gossip", n, tmp_path)
    for r, got in enumerate(results):
        assert got["half_args"] is not None and got["half_args"][1]
        p = got["partner"]
        if p is None:
            assert n % 2 == 1 and r == n - 1
            assert torch.equal(got["alone"], full(r))
            continue
        assert torch.equal(got["average"], full((r + p) / 2))
        assert torch.equal(got["weighted"], full(0.25 * r + 0.75 * p))


@pytest.mark.parametrize("n,local", [(4, 2), (6, 2), (6, 3), (3, 1)])
def test_hierarchical_neighbor_allreduce(n, local, tmp_path):
    results = run("hierarchical", n, tmp_path, extra_env={"BLUEFOG_NODES_PER_MACHINE": str(local)})
    machines = n // local
    w = tu.nx.to_numpy_array(tu.StarGraph(machines, machines - 1), nodelist=range(machines))
    for r, got in enumerate(results):
        m = r // local
        assert got["no_machine_topology"][0] == "RuntimeError"
        # Rank 0 passed a weighted fully connected graph, the others the ring.
        assert got["set_different"] is (n == 1) and got["kept_ring"]
        ins = ring_in(machines, m) if machines > 1 else []
        assert got["in_machines"] == ins
        expected = (m + sum(ins)) / (len(ins) + 1)
        assert torch.allclose(got["default"], torch.full((3,), expected, dtype=torch.float64),
                              rtol=1e-12, atol=1e-12), f"rank {r}"
        if machines > 1:
            assert torch.allclose(got["move"], torch.full((3,), float((m + 1) % machines),
                                                          dtype=torch.float64), atol=1e-12)
        assert got["not_a_neighbour"][1]
        star = sum(w[k, m] * k for k in range(machines))
        assert torch.allclose(got["star"], torch.full((3,), star, dtype=torch.float64), atol=1e-12)
        assert got["x_untouched"]


@pytest.mark.parametrize("n", [4, 5])
def test_documented_consensus_loops_reach_the_average(n, tmp_path):
    for got in run("consensus", n, tmp_path):
        for key in ("static", "dynamic"):
            assert got[key].item() == pytest.approx((n - 1) / 2, abs=1e-5), key


@pytest.mark.parametrize("n", [1, 3, 4])
def test_optimizer_formulas(n, tmp_path):
    results = run("optimizer_formulas", n, tmp_path)
    lr = 0.1

    def neighbour_average(values, r):
        ins = exp_in(n, r)
        return (values[r] + sum(values[j] for j in ins)) / (len(ins) + 1)
    x0 = [float(r) for r in range(n)]
    step = [x - lr * (r + 1) for r, x in enumerate(x0)]
    mean_grad = sum(r + 1 for r in range(n)) / n
    for r, got in enumerate(results):
        expected = {"awc": neighbour_average(x0, r) - lr * (r + 1),  # W x - lr g(x)
                    "atc": neighbour_average(step, r),               # W (x - lr g(x))
                    "gradient": x0[r] - lr * mean_grad,
                    "awc_allreduce": sum(x0) / n - lr * (r + 1)}
        for kind, value in expected.items():
            assert torch.allclose(got[kind], torch.full((1, 2), value, dtype=torch.float64),
                                  rtol=1e-12, atol=1e-12), f"{kind} rank {r}"
            assert got[kind + ".is_sgd"]
        # backward put the gradient into the open bucket (its accumulator's
        # hook); step() then sends and waits for it.
        assert got["gradient.in_flight_before_step"] == 1
        assert got["warned"]
        assert got["bad_model"] is not None and got["bad_model"][1]


@pytest.mark.parametrize("n", [2, 3])
def test_atc_matches_step_then_allreduce(n, tmp_path):
    """ATC with Adam over 3 steps gives what the plain Adam step followed by
    an explicit allreduce of every parameter gives, on every rank, and the
    ranks agree (the combination is an allreduce)."""
    results = run("atc_overlap_matches_reference", n, tmp_path)
    for r, got in enumerate(results):
        for a, b in zip(got["atc"], got["reference"]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), r
        assert all(torch.equal(a, b) for a, b in zip(got["atc"], results[0]["atc"]))


@pytest.mark.parametrize("n", [3])
def test_gradient_allreduce_optimizer_buckets(n, tmp_path):
    """The gradients go in buckets of BLUEFOG_FUSION_THRESHOLD bytes (one
    allreduce per gradient at 0); every bucketing gives the average gradient."""
    results = run("gradient_buckets", n, tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    model(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    mean_scale = sum(r + 1 for r in range(n)) / n
    expected = [p.detach() - 0.1 * mean_scale * p.grad for p in model.parameters()]
    for r, got in enumerate(results):
        # 40 bytes: several buckets, fewer than the 4 gradients (16, 48, 24
        # and 96 bytes; how they group follows autograd's order).
        for threshold, buckets in ((8 << 20, {1}), (40, {2, 3}), (0, {4})):
            weights, sent = got[threshold]
            assert sent in buckets, (r, threshold, sent)
            for w, e in zip(weights, expected):
                assert torch.allclose(w, e, rtol=1e-12, atol=1e-12), (r, threshold)
            assert all(torch.equal(a, b) for a, b in zip(weights, results[0][threshold][0]))
        # synchronize() then step() under skip_synchronize(): the averaged
        # gradients are in place before the step, and nothing is sent twice.
        for g, p in zip(got["synchronized_grads"], model.parameters()):
            assert torch.allclose(g, mean_scale * p.grad, rtol=1e-12, atol=1e-12), r
        for w, e in zip(got["skip_synchronize"], expected):
            assert torch.allclose(w, e, rtol=1e-12, atol=1e-12), r


CONVERGENCE = ["awc:empty:128", "atc:empty:128", "awc:allreduce:128", "atc:allreduce:128",
               "awc:neighbor_allreduce:128", "atc:neighbor_allreduce:128", "gradient:-:128",
               "awc:dynamic:128", "atc:dynamic:128", "awc:neighbor_allreduce:4",
               "awc:neighbor_allreduce:8", "atc:neighbor_allreduce:32", "gradient:-:32"]


def test_optimizers_reach_bluefogs_mse(tmp_path):
    """BlueFog's own optimizer test: the train and test MSE of the last three
    of 50 epochs below 1.5e-10 (2e-10 without communication), noise 1e-5."""
    results = run("optimizers", 4, tmp_path, args=CONVERGENCE, timeout=900)
    for config in CONVERGENCE:
        limit = 2e-10 if ":empty:" in config else 1.5e-10
        for train, test in results[0][config]:
            assert train < limit and test < limit, f"{config}: {results[0][config]}"


HIERARCHICAL = ["awc:hierarchical_neighbor_allreduce:128", "atc:hierarchical_neighbor_allreduce:128",
                "deprecated:hierarchical_neighbor_allreduce:128"]


def test_hierarchical_optimizers_reach_bluefogs_mse(tmp_path):
    """As above on 3 machines of 2 ranks, the ring between machines."""
    results = run("optimizers", 6, tmp_path, args=HIERARCHICAL, timeout=900,
                  extra_env={"BLUEFOG_NODES_PER_MACHINE": "2"})
    for config in HIERARCHICAL:
        for train, test in results[0][config]:
            assert train < 1.5e-10 and test < 1.5e-10, f"{config}: {results[0][config]}"


def test_timeline(tmp_path):
    results = run("timeline", 2, tmp_path / "on",
                  extra_env={"BLUEFOG_TIMELINE": str(tmp_path / "trace" / "bf_")})
    for r, got in enumerate(results):
        assert (tmp_path / "trace" / f"bf_{r}.json").exists()
        assert got["started"] and not got["started_twice"]
        assert got["ended"] and not got["ended_twice"]
        # ALLGATHER: bf.init's topology agreement.
        assert got["names"] == ["ALLGATHER", "ALLREDUCE a", "COMPUTE x", "NEIGHBOR_ALLREDUCE w",
                                "UPDATE y"]
    off = run("timeline", 1, tmp_path / "off")[0]
    assert not off["started"] and not off["ended"] and off["names"] is None


def test_queries_with_simulated_machines(tmp_path):
    results = run("queries", 4, tmp_path, extra_env={"BLUEFOG_NODES_PER_MACHINE": "2"})
    for r, got in enumerate(results):
        assert (got["rank"], got["size"], got["local_size"], got["machine_size"]) == (r, 4, 2, 2)
        assert (got["local_rank"], got["machine_rank"]) == (r % 2, r // 2)
        assert got["homogeneous"] and got["default_is_exponential"]
        assert got["in"] == exp_in(4, r)
        assert got["local_sum"] == (0 + 1 if r < 2 else 2 + 3)
        assert got["before_init"][1] and "bf.init()" in got["before_init"][2]
        assert got["reinit_in"] == [(r - 1) % 4]
        assert got["after_shutdown"][0] is False and got["after_shutdown"][1][1]
        assert got["init_again_in"] == exp_in(4, r)  # the default again


def test_queries_of_a_single_process(tmp_path):
    got = run("queries", 1, tmp_path)[0]
    assert (got["rank"], got["size"], got["local_rank"], got["local_size"]) == (0, 1, 0, 1)
    assert got["in"] == [] and got["out"] == [] and got["local_sum"] == 0


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_mismatched_patterns_raise_value_error_on_every_rank(n, tmp_path):
    results = run("mismatch", n, tmp_path)
    for r, got in enumerate(results):
        name, is_value_error, message = got["bad_dynamic"]
        assert is_value_error, f"rank {r}: {name} {message}"
        if n > 1:
            assert "rank 1 receives from 0, which does not send" in message
            assert got["bad_size"] is not None and got["bad_size"][1]
        else:
            assert got["bad_size"] is None
        for key, error in got["args"].items():
            if key == "renamed":
                assert error[0] == "TypeError" and "src_weights" in error[2]
            elif key == "duplicate" and n == 1:
                assert error[1]  # names itself
            else:
                assert error is not None and error[1], f"rank {r} {key}: {error}"
        ins = exp_in(n, r)
        assert torch.equal(got["after"], full((r + sum(ins)) / (len(ins) + 1)))
        assert got["set_different"] is (n == 1)
        assert got["kept_exponential"] is (n > 1) or n == 1
        assert got["set_same"] and got["set_again"]
        if r == 0:
            assert got["not_a_graph"][0] == "TypeError"
        else:
            assert got["not_a_graph"] is (n == 1)
        rin = ring_in(n, r)
        assert torch.allclose(got["after_set"], full((r + sum(rin)) / (len(rin) + 1)), rtol=1e-12)


def test_unchecked_mismatch_times_out_instead_of_hanging(tmp_path):
    results = run("unchecked_mismatch", 4, tmp_path, timeout=120,
                  extra_env={"BAGUA_COMM_TIMEOUT_S": "2"})
    name, is_value_error, message = results[0]["error"]
    assert "Timeout" in name and "neighbor_allreduce" in message and "rank 0 of 4" in message
    assert results[0]["seconds"] < 30
    # Ranks 1 to 3 have their messages and finish.
    assert all(got["error"] is None for got in results[1:])


def test_a_failed_communicator_fails_later_calls_clearly_until_rebuilt(tmp_path):
    """After the unchecked mismatch, the next matched call fails on every
    rank (Gloo closed rank 0's connections on its timeout), rank 0's at once
    naming the first failure and the remedy; bf.shutdown() and bf.init() on
    every rank then give working communicators."""
    results = run("unchecked_mismatch_then_rebuild", 4, tmp_path, timeout=120,
                  extra_env={"BAGUA_COMM_TIMEOUT_S": "2"})
    assert "Timeout" in results[0]["mismatch"][0]
    assert all(got["mismatch"] is None for got in results[1:])
    for r, got in enumerate(results):
        assert all(error is not None for error in got["errors"]), (r, got["errors"])
        # Once a rank has seen a communication error, its next call is
        # refused before any communication, naming the way out.
        name, _, message = got["errors"][-1]
        assert name == "BackendError" and "bf.shutdown() then bf.init()" in message, (r, message)
        assert f"rank {r}" in message
        for out in got["rebuilt"]:  # x_r = r: half its own, half its ring predecessor's
            assert torch.equal(out, torch.full((3, 2), 0.5 * r + 0.5 * ((r - 1) % 4), dtype=torch.float64))


def test_argument_errors_before_any_communication():
    import bagua.bluefog as bf
    if not bf.is_initialized():
        with pytest.raises(ValueError, match="bf.init"):
            bf.rank()
        with pytest.raises(ValueError, match="bf.init"):
            bf.neighbor_allreduce(torch.zeros(2))


# -- fusion of nonblocking neighbour allreduces ----------------------------------------
# A long cycle time makes the grouping deterministic: the worker proposes a
# run only once something queued closes it or a caller waits for a result.
PATIENT = {"BLUEFOG_CYCLE_TIME": "10000"}


def fusion_expected(kind, n, r, k, shape):
    """The closed form of call k of scenario fusion_mixed at rank r, in
    float64 (x_j = j + base_k, design section 7's table)."""
    numel = int(np.prod(shape)) if shape else 1
    base = (torch.arange(numel, dtype=torch.float64) * 0.37 + k / 7).reshape(shape)
    ins = exp_in(n, r)
    if kind == "default":
        return base + (r + sum(ins)) / (len(ins) + 1)
    if kind == "sum":
        return (len(ins) + 1) * base + r + sum(ins)
    if kind == "move":
        return base + (r - 1) % n
    if kind == "push_pull":
        return 0.5 * (len(ins) + 1) * base + 0.5 * (r + sum(ins))
    return 0.25 * (base + r) + sum(0.75 * (base + j) for j in ins[:1])  # partial


def fusion_runs(plan, threshold=8 << 20):
    """How many ops the plan's calls should take: maximal runs of one kind
    and dtype, cut at the threshold (bytes)."""
    ops, key, total = 0, None, 0
    for kind, dtype, shape in plan:
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        if (kind, dtype) != key or total + nbytes > threshold:
            ops, key, total = ops + 1, (kind, dtype), 0
        total += nbytes
    return ops


TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def fused_on_three(tmp_path_factory):
    """Scenario fusion_mixed on 3 ranks, shared by two tests."""
    return run("fusion_mixed", 3, tmp_path_factory.mktemp("fused3"), extra_env=PATIENT)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_fused_calls_equal_unfused_calls_bit_for_bit(n, tmp_path, fused_on_three):
    results = fused_on_three if n == 3 else run("fusion_mixed", n, tmp_path, extra_env=PATIENT)
    plan = results[0]["plan"]
    for r, got in enumerate(results):
        assert got["plan"] == plan and got["untouched"]
        for k, (kind, dtype, shape) in enumerate(plan):
            fused, alone = got["fused"][k], got["blocking"][k]
            assert fused.dtype == alone.dtype == dtype and fused.shape == alone.shape == shape
            assert torch.equal(fused, alone), f"rank {r} call {k} ({kind}, {dtype})"
            tol = TOLERANCE[dtype]
            assert torch.allclose(fused.double(), fusion_expected(kind, n, r, k, shape), rtol=tol,
                                  atol=tol), f"rank {r} call {k} ({kind}, {dtype})"
        before, after_fused, after_blocking = got["stats"]
        assert after_fused["calls"] - before["calls"] == 50
        assert after_fused["ops"] - before["ops"] == fusion_runs(plan) < 50
        # A blocking call runs alone, without an agreement between the ranks.
        assert after_blocking["ops"] - after_fused["ops"] == 50
        assert after_blocking["fused_ops"] == after_fused["fused_ops"]
        assert after_blocking["agreements"] == after_fused["agreements"]


def test_fusion_off_gives_the_same_bits(tmp_path, fused_on_three):
    fused = fused_on_three
    off = run("fusion_mixed", 3, tmp_path, extra_env=dict(PATIENT, BLUEFOG_FUSION_THRESHOLD="0"))
    for r in range(3):
        before, after, _ = off[r]["stats"]
        assert after["ops"] - before["ops"] == 50 and after["fused_ops"] == 0
        assert after["agreements"] == 0  # no fusion, no agreement
        for k in range(50):
            assert torch.equal(off[r]["fused"][k], fused[r]["fused"][k]), f"rank {r} call {k}"


def test_fusion_threshold_and_errors_on_their_own_handles(tmp_path):
    n = 3
    results = run("fusion_counts", n, tmp_path,
                  extra_env=dict(PATIENT, BLUEFOG_FUSION_THRESHOLD="800"))
    for r, got in enumerate(results):
        ins = got["ins"]
        avg = (r + sum(ins)) / (len(ins) + 1)
        for k, out in enumerate(got["f64"]):
            assert torch.equal(out, torch.full((10,), avg + k, dtype=torch.float64))
        for k, out in enumerate(got["f32"]):
            assert torch.allclose(out, torch.full((10,), avg + k), rtol=1e-6)
        assert torch.equal(got["large"][0], torch.full((300,), avg, dtype=torch.float64))
        s = got["stats"]
        delta = [{key: b[key] - a[key] for key in a} for a, b in zip(s, s[1:])]
        # 30 x 80 bytes in threes of 800; 50 x 40 bytes as 20 + 20 + 10.
        assert (delta[0]["ops"], delta[0]["fused_ops"], delta[0]["fused_calls"]) == (3, 3, 30)
        assert (delta[1]["ops"], delta[1]["fused_ops"], delta[1]["fused_calls"]) == (3, 3, 50)
        assert s[-1]["largest_fused_bytes"] == 800
        # 2400 bytes, over the threshold: runs, alone.
        assert (delta[2]["ops"], delta[2]["fused_ops"]) == (1, 0)
        a, b, integer, c, bad_size, d = got["bad"]
        for value, out in zip((1, 2, 3, 4), (a, b, c, d)):
            assert torch.equal(out, torch.full((4,), avg + value, dtype=torch.float64)), f"rank {r}"
        assert integer[1] and "floating point" in integer[2], integer
        assert bad_size[1], bad_size
        # a+b fused; the integer, c, the bad size and d alone: c's and the bad
        # size's digests differ between ranks, which cuts the runs there.
        assert (delta[3]["ops"], delta[3]["fused_ops"], delta[3]["fused_calls"]) == (5, 1, 2)
