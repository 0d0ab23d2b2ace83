"""Bagua's API beyond the primitives ("Drop-in for Bagua"): utils,
the rest of communication, data_parallel.DistributedDataParallel and
contrib, each checked against torch.distributed (Gloo, same processes) or
against plain Python."""

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import launcher

COMPAT_WORKERS = Path(__file__).with_name("compat_workers.py")


def run_compat(scenario, world_size, tmp_path, **kwargs):
    return launcher.run_workers(scenario, world_size, tmp_path, script=COMPAT_WORKERS, **kwargs)


def assert_pairs(results, skip=()):
    """Every (ours, reference) pair of every rank is equal."""
    for rank, result in enumerate(results):
        for key, value in result.items():
            if key in skip:
                continue
            ours, reference = value
            if isinstance(ours, torch.Tensor):
                assert ours.dtype == reference.dtype, f"rank {rank} {key}"
                assert torch.equal(ours, reference), f"rank {rank} {key}: {ours} != {reference}"
            else:
                assert _same(ours, reference), f"rank {rank} {key}: {ours!r} != {reference!r}"


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# -- bagua.torch_api.utils ------------------------------------------------------------
def test_utils_flatten_unflatten_and_contiguity():
    from bagua.torch_api import utils

    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = utils.flatten(tensors)
    assert flat.shape == (12,)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    back = utils.unflatten(flat, tensors)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, tensors))
    assert utils.check_contiguous(back)
    assert not utils.check_contiguous(tensors[:2])
    assert utils.check_contiguous([flat[:3], flat[3:5], flat[5:]])
    assert not utils.check_contiguous([flat[:3], flat[4:5]])
    assert torch.equal(utils.get_flattened_tensor(tensors), flat)
    assert utils.get_flattened_tensor([]) is None
    assert [utils.align_size(s, 8) for s in (0, 1, 8, 9, 16)] == [0, 8, 8, 16, 16]


def test_utils_apply_flattened_call():
    from bagua.torch_api import utils

    bucket = [torch.ones(2, 2), torch.arange(3.0)]
    utils.apply_flattened_call(bucket, lambda flat, k: flat.mul_(k), (3,))
    assert torch.equal(bucket[0], torch.full((2, 2), 3.0))
    assert torch.equal(bucket[1], torch.arange(3.0) * 3)
    seen = []
    mixed = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(1), torch.ones(2, dtype=torch.int64)]
    utils.apply_flattened_call_all(mixed, lambda flat: (seen.append((flat.dtype, flat.numel())), flat.add_(1)))
    assert seen == [(torch.float32, 3), (torch.float64, 3), (torch.int64, 2)]
    assert all(torch.equal(t, torch.full_like(t, 2)) for t in mixed)


def test_utils_flatten_module_params_and_collocate():
    from bagua.torch_api import utils

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    flat = utils.flatten_module_params(params, align_bytes=64)
    total = sum(p.numel() for p in params)
    assert flat.numel() == utils.align_size(total * 4, 64) // 4
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert torch.equal(params[0].grad, torch.ones_like(params[0]))
    assert torch.equal(params[1].grad, torch.zeros_like(params[1]))
    assert utils.check_contiguous([p.data for p in params])
    assert params[0].data_ptr() == flat.data_ptr() and params[0].grad.data_ptr() == flat.grad.data_ptr()
    # the output still trains: the forward reads the flat buffer
    x = torch.randn(4, 3)
    flat.data.mul_(0)
    assert torch.equal(model(x), torch.zeros(4, 2))
    span = utils.collocate_params(params[1:3])
    assert span.numel() == params[1].numel() + params[2].numel()
    assert span.data_ptr() == params[1].data_ptr() and span.grad.data_ptr() == params[1].grad.data_ptr()
    assert utils.collocate_params(params[:1]) is params[0]
    with pytest.raises(ValueError):
        utils.collocate_params([params[0], params[2]])


def test_utils_datatypes_and_reduce_ops():
    import torch.distributed as dist

    from bagua.torch_api import ReduceOp, utils

    assert [utils.to_bagua_datatype(d) for d in (torch.float32, torch.float16, torch.uint8, torch.int64)] == [
        "f32", "f16", "u8", "i64"]
    with pytest.raises(ValueError):
        utils.to_bagua_datatype(torch.float64)
    assert utils.to_bagua_reduce_op(dist.ReduceOp.SUM) == ReduceOp.SUM == 0
    assert utils.to_bagua_reduce_op(dist.ReduceOp.MAX) == ReduceOp.MAX
    assert utils.to_bagua_reduce_op(dist.ReduceOp.BXOR) == ReduceOp.BXOR == 9


def _reference_average(raw):
    """Bagua's outlier-removing average, as its documentation states it."""
    xs = list(raw)[len(raw) // 3:]

    def keep(values):
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        kept = [v for v in values if abs(v - mean) < std]
        return kept or values

    xs = keep(xs)
    for _ in range(10):
        mean = sum(xs) / len(xs)
        if math.sqrt(sum((v - mean) ** 2 for v in xs) / len(xs)) < mean:
            break
        xs = keep(xs)
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in xs) / len(xs)), xs


@pytest.mark.parametrize("raw", [
    [100, 1, 1.2, 0.9, 1.1, 1.0, 5.0, 1.05, 0.95],
    [3.0] * 7,
    [0.1, 50, -20, 30, 10, 0.0, -5, 7, 100, 2],
])
def test_utils_average_by_removing_extreme_values(raw):
    from bagua.torch_api.utils import average_by_removing_extreme_values

    mean, std, kept = average_by_removing_extreme_values(raw)
    ref_mean, ref_std, ref_kept = _reference_average(raw)
    assert kept == pytest.approx(ref_kept)
    assert mean == pytest.approx(ref_mean) and std == pytest.approx(ref_std)


def test_utils_statistical_average_bagua_case():
    """Bagua's own test of StatisticalAverage."""
    from bagua.torch_api.utils import StatisticalAverage

    m = StatisticalAverage(last_update_time=time.time(), records=[5.0, 4.5005175, 3.5034241850204078],
                           record_tail=(2.0166309999999985, 2.499061185570463))
    time.sleep(1)
    m.record(6.0)
    expected = [(1.0, 6.0), (2.0, (6.0 + 5.0) / 2.0), (3.0, (6.0 + 4.5005175 * 2.0) / 3.0),
                (5.0, (6.0 + 3.5034241850204078 * 4.0) / 5.0),
                (7.0, (6.0 + 2.499061185570463 * (4.0 + 2.0166309999999985)) / 7.0)]
    for seconds, value in expected:
        assert np.isclose(m.get_records_mean(seconds), value, atol=0.1), (seconds, m)
    assert np.isclose(m.total_recording_time(), 4.0 + 2.0166309999999985 + 1, atol=0.1)


def test_utils_statistical_average_constant_and_fresh_defaults():
    from bagua.torch_api.utils import StatisticalAverage

    a, b = StatisticalAverage(), StatisticalAverage()
    assert a.records is not b.records and abs(a.last_update_time - time.time()) < 5
    assert a.get_records_mean(4.0) == 0.0 and a.get(1.0) == 0.0
    a.last_update_time -= 10.0
    a.record(2.5)  # ten seconds of 2.5: every span up to 8 s is 2.5, then a tail
    assert a.records == [2.5] * 4
    assert a.record_tail[0] == pytest.approx(10.0 - 8.0, abs=0.05)
    for seconds in (0.5, 1, 3, 8, 9.5, 100):
        assert a.get_records_mean(seconds) == pytest.approx(2.5)
    assert "records" in str(a)


# -- bagua.torch_api.communication ----------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_communication_extras_equal_torch_distributed(world_size, tmp_path):
    results = run_compat("communication", world_size, tmp_path)
    for rank, result in enumerate(results):
        error = result.pop("alltoall_v/error")
        assert error is not None and error.startswith("InvalidArgumentError"), f"rank {rank}: {error}"
        assert f"rank {world_size - 1} sends" in error and "rank 0" in error
        error = result.pop("alltoall_v/two_more_displs")
        assert error is not None and "send_displs must have one entry per rank" in error, error
        assert any(k.startswith("gather_inplace/") for k in result)
    assert_pairs(results)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_from_torch_group(world_size, tmp_path):
    results = run_compat("torch_groups", world_size, tmp_path)
    for rank, result in enumerate(results):
        assert ("evens" in result) == (rank % 2 == 0)
    assert_pairs(results)


def test_api_names_are_exported():
    import bagua.torch_api as bagua
    from bagua.torch_api import communication

    for name in ("broadcast_object", "from_torch_group", "CommMember", "alltoall_v", "alltoall_v_inplace",
                 "gather_inplace", "scatter_inplace", "allreduce_coalesced_inplace", "broadcast_coalesced",
                 "get_backend"):
        assert hasattr(communication, name) and name in communication.__all__, name
    for name in ("get_backend", "alltoall_v", "alltoall_v_inplace", "gather_inplace", "scatter_inplace"):
        assert getattr(bagua, name) is getattr(communication, name)
    assert bagua.utils.flatten and bagua.communication is communication and bagua.data_parallel


# -- bagua.torch_api.data_parallel -------------------------------------------------------
def assert_close_pairs(results):
    for rank, result in enumerate(results):
        for key, (ours, reference) in result.items():
            if isinstance(ours, list) and ours and isinstance(ours[0], torch.Tensor):
                assert len(ours) == len(reference), f"rank {rank} {key}"
                for a, b in zip(ours, reference):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
            elif isinstance(ours, torch.Tensor):
                torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
            else:
                assert _same(ours, reference), f"rank {rank} {key}: {ours!r} != {reference!r}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_distributed_data_parallel_equals_torch_ddp(world_size, tmp_path):
    results = run_compat("ddp", world_size, tmp_path, extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "1000"})
    assert "sgd/sync_every3/viewFalse" in results[0] and "find_unused/True/train" in results[0]
    assert_close_pairs(results)
    if world_size > 1:  # the ignored parameter really stayed local (ranks differ)
        assert not torch.equal(results[0]["ignored"][0][-1], results[1]["ignored"][0][-1])
        assert not torch.equal(results[0]["no_sync/local_grad"][0], results[1]["no_sync/local_grad"][0])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_functional_all_reduce_value_and_gradient(world_size, tmp_path):
    assert_pairs(run_compat("functional", world_size, tmp_path))


# -- bagua.torch_api.contrib ---------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(world_size, tmp_path):
    results = run_compat("sync_bn", world_size, tmp_path)
    assert "momentumNone/dims4/input_grad1" in results[0]
    assert_close_pairs(results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_batchnorm_trains_with_distributed_data_parallel(world_size, tmp_path):
    assert_close_pairs(run_compat("sync_bn_ddp", world_size, tmp_path))


def _dataset(costs):
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.arange(len(costs)), torch.tensor(costs))


def test_load_balancing_sampler_bagua_cases():
    """Bagua's own two sampler tests."""
    from torch.utils.data import DataLoader, TensorDataset

    from bagua.torch_api.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    n = 10
    dataset = TensorDataset(torch.randn(n, 2), torch.randperm(n))
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1], num_replicas=1, rank=0,
                                              shuffle=False)
    for i, data in enumerate(DataLoader(dataset, batch_size=1, sampler=sampler)):
        assert i == data[1].item()

    total_batch = 5
    n = sum(i + 1 for i in range(total_batch))
    dataset = TensorDataset(torch.randn(n, 2), torch.randperm(n))

    def growing_batches(indices):
        batch, size = [], 1
        for i in indices:
            batch.append(i)
            if len(batch) == size:
                yield batch
                batch, size = [], size + 1
        if batch:
            yield batch

    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1], num_replicas=1, rank=0,
                                              shuffle=False)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=lambda x: list(growing_batches(x)))
    cur = 0
    for i, data in enumerate(DataLoader(dataset, batch_sampler=batch_sampler)):
        assert data[0].shape[0] == i + 1 and data[1][0].item() == cur
        cur += data[0].shape[0]
    assert len(batch_sampler) == total_batch


def _reference_unshuffled(costs, replicas, rank, drop_last=False):
    """The documented split without shuffling: sort by cost, cut into chunks
    of `replicas`, wrap around to fill, rank r takes the r-th of each chunk."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    if drop_last and len(costs) % replicas:
        per_rank = math.ceil((len(costs) - replicas) / replicas)
    else:
        per_rank = math.ceil(len(costs) / replicas)
    wrapped = [order[i % len(order)] for i in range(per_rank * replicas)]
    return [wrapped[c * replicas + rank] for c in range(per_rank)]


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_load_balancing_sampler_split(replicas, drop_last):
    from bagua.torch_api.contrib import LoadBalancingDistributedSampler

    g = torch.Generator().manual_seed(replicas)
    costs = torch.randint(0, 50, (23,), generator=g).tolist()
    dataset = _dataset(costs)
    cost = lambda sample: int(sample[1])  # noqa: E731
    unshuffled = [list(LoadBalancingDistributedSampler(dataset, cost, replicas, r, shuffle=False,
                                                       drop_last=drop_last)) for r in range(replicas)]
    for r in range(replicas):
        assert unshuffled[r] == _reference_unshuffled(costs, replicas, r, drop_last)
    for epoch in (0, 1):
        samplers = [LoadBalancingDistributedSampler(dataset, cost, replicas, r, seed=4, drop_last=drop_last)
                    for r in range(replicas)]
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert all(len(p) == len(samplers[0]) == samplers[0].num_samples for p in per_rank)
        # step by step the ranks hold one chunk of the cost order (which
        # wraps around to pad): with random_level 0, neighbouring costs
        cyclic = sorted(costs) * 2
        for step in zip(*per_rank):
            step_costs = sorted(costs[i] for i in step)
            assert any(sorted(cyclic[k:k + replicas]) == step_costs for k in range(len(costs)))
        if not drop_last:
            assert set().union(*map(set, per_rank)) == set(range(len(costs)))
        # same seed and epoch: same order, whichever object computes it
        again = LoadBalancingDistributedSampler(dataset, cost, replicas, 0, seed=4, drop_last=drop_last)
        again.set_epoch(epoch)
        assert list(again) == per_rank[0]
    first = LoadBalancingDistributedSampler(dataset, cost, replicas, 0, seed=4)
    second = LoadBalancingDistributedSampler(dataset, cost, replicas, 0, seed=4)
    second.set_epoch(1)
    assert list(first) != list(second) or len(first) < 3


def test_load_balancing_sampler_random_level_and_errors():
    from bagua.torch_api.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    costs = list(range(40))
    dataset = _dataset(costs)
    cost = lambda sample: int(sample[1])  # noqa: E731
    tight = LoadBalancingDistributedSampler(dataset, cost, 2, 0, random_level=0)
    loose = LoadBalancingDistributedSampler(dataset, cost, 2, 0, random_level=1)
    assert tight.random_number == 1 and loose.random_number == 40
    assert sorted(loose) != sorted(tight) or list(loose) != list(tight)
    with pytest.raises(ValueError):
        LoadBalancingDistributedSampler(dataset, cost, 2, 2)
    with pytest.raises(ValueError):
        LoadBalancingDistributedSampler(dataset, cost, 2, 0, random_level=1.5)
    with pytest.raises(ValueError):
        LoadBalancingDistributedBatchSampler(LoadBalancingDistributedSampler(dataset, cost, 2, 0, drop_last=True),
                                             batch_fn=lambda idx: [idx])
    with pytest.raises(ValueError):
        LoadBalancingDistributedBatchSampler(object(), batch_fn=lambda idx: [idx])


@pytest.mark.parametrize("drop_last", [False, True])
def test_load_balancing_batch_sampler_pads_or_drops(drop_last):
    from bagua.torch_api.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    costs = list(range(30))
    dataset = _dataset(costs)
    cost = lambda sample: int(sample[1])  # noqa: E731

    def batch_fn(indices):  # batches of at most 10 cost units: cheap ranks get fewer batches
        batches, batch, load = [], [], 0
        for i in indices:
            if batch and load + costs[i] > 10:
                batches.append(batch)
                batch, load = [], 0
            batch.append(i)
            load += costs[i]
        return batches + ([batch] if batch else [])

    replicas = 3
    samplers = [LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(dataset, cost, replicas, r, shuffle=False), batch_fn, drop_last)
        for r in range(replicas)]
    own = [batch_fn(list(s.sampler)) for s in samplers]
    expected = min(map(len, own)) if drop_last else max(map(len, own))
    assert len({len(b) for b in own}) > 1  # the case is uneven
    for s, batches in zip(samplers, own):
        got = list(s)
        assert len(s) == len(got) == expected
        assert got == [batches[i % len(batches)] for i in range(expected)]
    samplers[0].set_epoch(3)
    assert samplers[0].sampler.epoch == 3 and len(list(samplers[0])) == len(samplers[0])


@pytest.mark.parametrize("world_size", [3])
def test_what_bagua_upstream_tests_need(world_size, tmp_path):
    results = run_compat("upstream_findings", world_size, tmp_path)
    members = world_size - 1
    for rank, r in enumerate(results):
        if rank < members:
            assert torch.equal(r["sub_allreduce"], torch.full((4,), float(sum(range(1, members + 1)))))
            assert not r["non_member_marker"]
        else:  # outside the group: the call did nothing, the module trained alone
            assert torch.equal(r["sub_allreduce"], torch.full((4,), float(rank + 1)))
            assert r["non_member_marker"]
        assert r["async_trained"]
        assert r["peer_weight"].shape == (10,)
        assert r["low_precision_copies"] == [(10,), (10,), (10,)]
        assert r["rewrap"] is None, r["rewrap"]
        assert torch.equal(r["rewrap_weight"], results[0]["rewrap_weight"])
        assert r["init_bagua_communicator"][0] == world_size
        assert torch.equal(r["init_bagua_communicator"][1], torch.full((3,), float(sum(range(world_size)))))
    # "all": every rank's peer weight is the global average
    assert all(torch.equal(r["peer_weight"], results[0]["peer_weight"]) for r in results)


def test_old_import_paths():
    import bagua.autotune
    from bagua.torch_api.contrib import FusedOptimizer
    from bagua.torch_api.fuse_optimizer import FusedOptimizer as Old

    assert Old is FusedOptimizer and bagua.autotune.IntParam is not None
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    reference = [p.detach().clone() - 0.1 * 0.5 for p in params]
    fused = FusedOptimizer(torch.optim.SGD(params, lr=0.1), do_flatten=True)
    fused.step()
    assert all(torch.allclose(p, r) for p, r in zip(params, reference))
    assert fused.param_groups[0]["lr"] == 0.1


def test_what_bagua_examples_need(tmp_path):
    results = run_compat("examples_findings", 2, tmp_path)
    for r in results:
        for t in r["low_level"]:  # averaged: the mean of 1 and 2
            assert torch.equal(t, torch.full((64, 4), 1.5))
        assert r["iteration"] == 7
        assert r["experts_differ"] and r["not_restored"] == [], r["not_restored"]
    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import onebit_adam
    from bagua.torch_api.ddp_compatible import DistributedDataParallel

    assert DistributedDataParallel is bagua.data_parallel.DistributedDataParallel
    assert bagua.moe.MoE is not None and bagua.checkpoint.save_checkpoint is not None
    optimizer = onebit_adam.OnebitAdamOptimizer([torch.nn.Parameter(torch.ones(2))])
    onebit_adam.OnebitAdamAlgorithm(optimizer, 10)
    assert optimizer.warmup_steps == 10
