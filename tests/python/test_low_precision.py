"""Low-precision algorithms across processes: QAdam against Adam, ByteGrad
against an exact allreduce, low-precision decentralized against a
pure-Python reference of its update and the ring invariant."""

import pytest
import torch

from launcher import run_workers
import minmax_reference as ref


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_qadam_warmup_equals_adam(world_size, tmp_path):
    results = run_workers("qadam", world_size, tmp_path)
    for rank, r in enumerate(results):
        for ours, adam in zip(r["qadam_warmup"], r["adam"]):
            if world_size == 1:
                assert torch.equal(ours, adam), "one rank: QAdam's warmup is exactly Adam"
            else:  # gradients averaged by DDP and by bagua in different orders
                torch.testing.assert_close(ours, adam, rtol=1e-5, atol=1e-6)
        # after warmup the momentum is communicated compressed...
        assert "centralized_low_precision" in r["ops"]
        # ...and every rank decodes the same bytes: the models stay identical
        for ours, rank0 in zip(r["qadam_after"], results[0]["qadam_after"]):
            assert torch.equal(ours, rank0)
        assert any(not torch.equal(a, b) for a, b in zip(r["qadam_after"], r["qadam_warmup"]))


@pytest.mark.parametrize("world_size", [3, 4])
def test_bytegrad_gradients_within_the_quantization_bound(world_size, tmp_path):
    results = run_workers("bytegrad", world_size, tmp_path, local_size=2)
    for r in results:
        for hierarchical in (False, True):
            out = r[hierarchical]
            # A chunk spans several gradients: bound with the range of all of
            # them over all ranks. Each rank's chunk is quantized once (error
            # <= range / 510, averaged over ranks), the reduced chunk once more.
            everything = torch.cat([g.reshape(-1) for res in results for g in res[hierarchical]["local"]])
            bound = 2 * (everything.max() - everything.min()).item() / 510 + 1e-6
            for i, (ours, exact) in enumerate(zip(out["bagua"], out["exact"])):
                assert (ours - exact).abs().max().item() <= bound, (hierarchical, i)
                assert not torch.equal(ours, exact)  # it was compressed
            ops = out["bytes"]["buckets"][0]["ops"][0]
            assert ops["name"] == "centralized_low_precision" and ops["bytes_sent"] > 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_low_precision_decentralized_matches_reference_and_ring_invariant(world_size, tmp_path):
    results = run_workers("low_precision_decentralized", world_size, tmp_path)
    lr = results[0]["lr"]
    n = world_size
    for step in range(len(results[0]["steps"])):
        s = [r["steps"][step] for r in results]
        for rank in range(n):
            left, right = (rank - 1) % n, (rank + 1) % n
            w_after = s[rank]["after"][0]
            # ring invariant, bit for bit
            assert torch.equal(s[left]["after"][2], w_after), (step, rank)
            assert torch.equal(s[right]["after"][1], w_after), (step, rank)
            assert torch.equal(s[rank]["params"], w_after)
            # pure-Python reference of the update (chunks of 2^16 elements)
            W, L, R = s[rank]["before"]
            x = W - lr * s[rank]["grad"]
            chunk = 1 << 16

            def diff(r_):
                W_, L_, R_ = s[r_]["before"]
                x_ = W_ - lr * s[r_]["grad"]
                return x_ + L_ / 3 + R_ / 3 - 5 * W_ / 3

            expected_w = W + ref.roundtrip_chunked(diff(rank), chunk)
            expected_l = L + ref.roundtrip_chunked(diff(left), chunk)
            expected_r = R + ref.roundtrip_chunked(diff(right), chunk)
            torch.testing.assert_close(w_after, expected_w, rtol=0, atol=1e-5)
            torch.testing.assert_close(s[rank]["after"][1], expected_l, rtol=0, atol=1e-5)
            torch.testing.assert_close(s[rank]["after"][2], expected_r, rtol=0, atol=1e-5)
            assert not torch.equal(w_after, x)  # communication changed the weights


# -- LowPrecisionDecentralizedAlgorithm(topology=...): low-precision neighbour averaging

F32 = torch.float32


def _lp_neighbor_reference(kind, n, lr, steps, order):
    """All ranks simulated here from the formulas: each rank's own Net and
    SGD on its own data; after the optimizer step with x the weights (in the
    bucket's order), d = x + (w_ii - 2) W + sum_j w_ij X_j (float32, term by
    term), Q(d) with the Python MinMaxUInt8 reference, X_j += Q^-1(Q(d_j)),
    x = W = W + Q^-1(Q(d)). Returns every rank's W after every step."""
    import torch.nn.functional as F
    import workers
    from bagua.bluefog import topology_util as tu

    graph = workers.lp_topology(kind, n)
    recv = [tu.GetRecvWeights(graph, r) for r in range(n)]
    models, opts = [], []
    for _ in range(n):
        torch.manual_seed(7)
        models.append(workers.Net())
        opts.append(torch.optim.SGD(models[-1].parameters(), lr=lr))
    data = [workers.batches(r, steps=steps) for r in range(n)]

    def flat(model):
        params = list(model.parameters())
        return torch.cat([params[i].detach().reshape(-1) for i in order])

    def unflat(model, v):
        params, offset = list(model.parameters()), 0
        with torch.no_grad():
            for i in order:
                params[i].copy_(v[offset:offset + params[i].numel()].view_as(params[i]))
                offset += params[i].numel()

    W = [flat(m).clone() for m in models]
    X = [{j: W[j].clone() for j in recv[r][1]} for r in range(n)]
    history = []
    for step in range(steps):
        decoded = []
        for r in range(n):
            x, y = data[r][step]
            opts[r].zero_grad()
            F.cross_entropy(models[r](x), y).backward()
            opts[r].step()
            self_weight, sources = recv[r]
            diff = flat(models[r]).clone()
            diff = W[r] * torch.tensor(self_weight - 2.0, dtype=F32) + diff
            for j in sorted(sources):
                diff = X[r][j] * torch.tensor(sources[j], dtype=F32) + diff
            decoded.append(ref.roundtrip_chunked(diff, 1 << 16))
        for r in range(n):
            for j in X[r]:
                X[r][j] = X[r][j] + decoded[j]
            W[r] = W[r] + decoded[r]
            unflat(models[r], W[r])
        history.append([w.clone() for w in W])
    return history


@pytest.mark.parametrize("kind,world_size", [("exponential", 2), ("ring", 3), ("star", 5)])
def test_low_precision_neighbor_matches_the_reference_and_keeps_replicas_exact(kind, world_size, tmp_path):
    from bagua.bluefog import topology_util as tu
    import workers

    results = run_workers("low_precision_neighbor", world_size, tmp_path, args=(kind,))
    n, steps = world_size, len(results[0]["steps"])
    graph = workers.lp_topology(kind, n)
    assert all(r["ops"] == ["low_precision_neighbor_allreduce"] for r in results)
    for rank, r in enumerate(results):
        assert r["sources"] == sorted(tu.GetRecvWeights(graph, rank)[1])
    reference = _lp_neighbor_reference(kind, n, results[0]["lr"], steps, results[0]["order"])
    worst = 0.0
    for step in range(steps):
        for rank in range(n):
            s = results[rank]["steps"][step]
            assert torch.equal(s["bucket"], s["weight"])  # x = W after each step
            # every out-neighbour's replica of this rank equals its W, bit for bit
            for out in tu.GetSendWeights(graph, rank)[1]:
                assert torch.equal(results[out]["steps"][step]["replicas"][rank], s["weight"]), (step, rank, out)
            worst = max(worst, (s["weight"] - reference[step][rank]).abs().max().item())
    print(f"{kind} world {n}: largest difference from the reference over {steps} steps: {worst:.3g}")
    assert worst <= 1e-6, worst
    # the ranks' weights differ (each trains on its own data) and moved
    assert not torch.equal(results[0]["steps"][-1]["weight"], results[1]["steps"][-1]["weight"])


def test_low_precision_neighbor_with_lr_zero_reaches_consensus(tmp_path):
    steps = 20
    results = run_workers("low_precision_neighbor", 4, tmp_path, args=("ring", "0", str(steps)))
    distances = []
    for step in range(steps):
        weights = torch.stack([r["steps"][step]["weight"] for r in results])
        distances.append((weights - weights.mean(0)).norm(dim=1).max().item())
    print("distance to the ranks' mean per step:", " ".join(f"{d:.3g}" for d in distances))
    # RingGraph(4) mixes with factor 1/3 per step in full precision
    assert distances[0] > 1.0  # the weights were made to differ by ~N(0, 1) per element
    assert distances[4] < 0.1 * distances[0]
    assert distances[-1] < 1e-4 * distances[0]
    assert all(b <= a * 1.01 for a, b in zip(distances, distances[1:])), distances


def test_low_precision_neighbor_trains_digits_like_full_precision(tmp_path):
    from test_q_adam import run_digits

    args = ("--topology", "star", "--epochs", "5")
    full, _ = run_digits(tmp_path, 3, "decentralized_topology", *args)
    low, _ = run_digits(tmp_path, 3, "low_precision_decentralized_topology", *args)
    print(f"digits, StarGraph(3), 5 epochs: full precision {full['rank_accuracies']}, "
          f"low precision {low['rank_accuracies']}")
    assert min(full["rank_accuracies"]) > 0.85
    for accuracy in low["rank_accuracies"]:
        assert accuracy >= min(full["rank_accuracies"]) - 0.02, (low, full)


class _Group:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def get_rank(self):
        return self.rank

    def get_size(self):
        return self.size


def test_low_precision_neighbor_arguments_are_checked():
    import bagua.torch_api as bagua
    from bagua.bluefog import topology_util as tu
    from bagua.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm

    with pytest.raises(bagua.InvalidArgumentError, match="hierarchical=False"):
        LowPrecisionDecentralizedAlgorithm(topology=tu.RingGraph(4))
    with pytest.raises(bagua.InvalidArgumentError, match="topology must be a static networkx.DiGraph"):
        LowPrecisionDecentralizedAlgorithm(
            hierarchical=False, topology=tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialGraph(4), 0))
    with pytest.raises(bagua.InvalidArgumentError, match="topology must be a static networkx.DiGraph"):
        LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=[[0, 1], [1, 0]])
    with pytest.raises(bagua.InvalidArgumentError, match="communication_interval"):
        LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=0, topology=tu.RingGraph(4))
    algorithm = LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=tu.RingGraph(4))
    with pytest.raises(bagua.InvalidArgumentError, match="LowPrecisionDecentralizedAlgorithm: the topology must "
                                                         "have the 3 nodes"):
        algorithm.reify(_Group(0, 3))
    heavy = tu.nx.DiGraph()
    heavy.add_weighted_edges_from([(0, 1, 0.9), (1, 0, 0.9), (0, 0, 0.5), (1, 1, 0.5)])
    with pytest.raises(bagua.InvalidArgumentError, match="sum to 1.4"):
        LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=heavy).reify(_Group(0, 2))
    # the pattern each rank runs: GetRecvWeights in, out-neighbours out
    star = LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=tu.StarGraph(5))
    centre, leaf = star.reify(_Group(0, 5)), star.reify(_Group(3, 5))
    assert centre.pattern == (pytest.approx(0.2), {r: pytest.approx(0.2) for r in (1, 2, 3, 4)}, [1, 2, 3, 4])
    assert leaf.pattern == (pytest.approx(0.8), {0: pytest.approx(0.2)}, [0]) and leaf.sources == [0]
    unweighted = tu.nx.DiGraph()
    unweighted.add_edges_from([(0, 1), (1, 2), (2, 0)])
    impl = LowPrecisionDecentralizedAlgorithm(hierarchical=False, topology=unweighted).reify(_Group(1, 3))
    assert impl.pattern == (0.5, {0: 0.5}, [2])
    # a checkpoint of the ring (or of other neighbours) is refused
    with pytest.raises(bagua.InvalidArgumentError, match="topology differs"):
        leaf.load_state_dict(None, {"peer_weights": {}})
    with pytest.raises(bagua.InvalidArgumentError, match="topology differs"):
        leaf.load_state_dict(None, {"peer_weights": {}, "sources": [1]})
    ring = LowPrecisionDecentralizedAlgorithm(hierarchical=False).reify(_Group(0, 3))
    with pytest.raises(bagua.InvalidArgumentError, match="topology differs"):
        ring.load_state_dict(None, {"peer_weights": {}, "sources": [1]})
