"""CUDA kernels against the CPU path. These run only where a GPU is present;
elsewhere every test is skipped with the reason."""

from pathlib import Path

import pytest
import torch

import bagua_core
from bucket_op_harness import OPS, run_bucket_op, stream, view
from launcher import run_workers

GPU_WORKERS = Path(__file__).with_name("gpu_workers.py")
HAVE_GPU = bagua_core.cuda_compiled() and bagua_core.cuda_device_count() > 0 and torch.cuda.is_available()
gpu = pytest.mark.skipif(
    not HAVE_GPU,
    reason=("no usable CUDA device (bagua built with CUDA: %s, devices: %d, torch.cuda: %s); "
            "the GPU checks run on a GPU machine" % (bagua_core.cuda_compiled(), bagua_core.cuda_device_count(),
                                                     torch.cuda.is_available())))



def cpu_compress_chunks(x, chunk):
    parts = []
    for begin in range(0, x.numel(), chunk):
        part = x[begin:begin + chunk].contiguous()
        out = torch.zeros(bagua_core._testing.minmax_uint8_compressed_bytes(part.numel()), dtype=torch.uint8)
        bagua_core._testing.minmax_uint8_compress(view(part), view(out))
        parts.append(out)
    return torch.cat(parts)


# (n, chunk): single elements, one slice, chunks of several 4096-element
# slices with a short last slice, the runtime's C_LP_S (numel / 8) and D_LP_S
# (65536) chunkings, last chunks under 16 elements (no room for partials).
CHUNKINGS = [(1, 1), (20, 3), (1000, 1000), (4097, 1024), (5000, 4999), (70001, 8751),
             (100003, 65536), (1 << 20, 1 << 16)]


# A NaN or Inf in one chunk, where there are several chunks to keep finite.
CASES = [(n, chunk, special) for n, chunk in CHUNKINGS for special in (None, "nan", "inf")
         if special is None or n >= 20]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,chunk,special", CASES)
def test_compression_codes_equal_the_cpu_bit_for_bit(dtype, n, chunk, special):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1).to(dtype)
    if special is not None:
        x[n // 2] = float(special)  # one chunk (and one slice of it) turns non-finite
    expected = cpu_compress_chunks(x, chunk)
    gpu_x = x.cuda()
    out = torch.zeros(expected.numel(), dtype=torch.uint8, device="cuda")
    bagua_core._testing.cuda_minmax_uint8_compress(view(gpu_x), chunk, out.data_ptr(), stream())
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    decoded = torch.zeros_like(gpu_x)
    bagua_core._testing.cuda_minmax_uint8_decompress(out.data_ptr(), chunk, view(decoded), False, stream())
    cpu_decoded = torch.cat([_cpu_decompress(p, x[b:b + chunk]) for b, p in _chunks(expected, x, chunk)])
    torch.cuda.synchronize()
    torch.testing.assert_close(decoded.cpu(), cpu_decoded, rtol=0, atol=0, equal_nan=True)


# Aligned chunks take the kernels' vector path, an input shifted by one
# element the element-wise one; both must give the CPU's codes, and decompress
# must accumulate as the CPU does.
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,chunk", [(4097, 1024), (70001, 8751), (100003, 65536), (1 << 20, 1 << 17)])
@pytest.mark.parametrize("offset", [0, 1])
def test_decompress_accumulates_like_the_cpu_aligned_or_not(dtype, n, chunk, offset):
    g = torch.Generator().manual_seed(n + offset)
    x = (torch.randn(n, generator=g) * 3 + 1).to(dtype)
    start = (torch.randn(n, generator=g) * 5).to(dtype)
    expected = cpu_compress_chunks(x, chunk)
    gpu_storage = torch.zeros(n + offset, dtype=dtype, device="cuda")
    gpu_storage[offset:] = x.cuda()
    gpu_x = gpu_storage[offset:]
    out = torch.zeros(expected.numel() + offset, dtype=torch.uint8, device="cuda")
    packed = out[offset:]
    bagua_core._testing.cuda_minmax_uint8_compress(view(gpu_x), chunk, packed.data_ptr(), stream())
    torch.cuda.synchronize()
    assert torch.equal(packed.cpu(), expected)
    target_storage = torch.zeros(n + offset, dtype=dtype, device="cuda")
    target_storage[offset:] = start.cuda()
    target = target_storage[offset:]
    bagua_core._testing.cuda_minmax_uint8_decompress(packed.data_ptr(), chunk, view(target), True, stream())
    cpu_target = start.clone()
    for begin, part in _chunks(expected, x, chunk):
        piece = cpu_target[begin:begin + chunk]
        bagua_core._testing.minmax_uint8_decompress(view(part), view(piece), True)
    torch.cuda.synchronize()
    torch.testing.assert_close(target.cpu(), cpu_target, rtol=0, atol=0, equal_nan=True)


def _chunks(packed, x, chunk):
    offset = 0
    for begin in range(0, x.numel(), chunk):
        size = min(chunk, x.numel() - begin)
        yield begin, packed[offset:offset + 8 + size]
        offset += 8 + size


def _cpu_decompress(packed, like):
    out = torch.zeros_like(like)
    bagua_core._testing.minmax_uint8_decompress(view(packed), view(out))
    return out


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("mean", [False, True])
def test_chunked_reduce_matches_the_cpu(dtype, mean):
    chunks, n = 5, 100_003
    x = (torch.randn(chunks * n, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    out = torch.zeros(n, dtype=dtype, device="cuda")
    gx = x.cuda()
    bagua_core._testing.cuda_chunked_reduce(view(gx), chunks, view(out), mean, stream())
    torch.cuda.synchronize()
    reference = x.view(chunks, n).double().sum(0)
    if mean:
        reference = reference / chunks if dtype.is_floating_point else torch.trunc(reference / chunks)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.int32: 0}[dtype]
    torch.testing.assert_close(out.cpu().double(), reference, rtol=tolerance, atol=tolerance * 10)


@gpu
def test_async_update_and_divide_match_the_formula():
    n, ranks = 10_000, 4
    g = torch.Generator().manual_seed(2)
    w, total, snapshot = (torch.randn(n, generator=g) for _ in range(3))
    # Every device tensor held by a name: a temporary's memory returns to
    # torch's allocator as soon as its view is taken, and the next one reuses it.
    gw, gtotal, gsnapshot = w.cuda(), total.cuda(), snapshot.cuda()
    bagua_core._testing.cuda_async_average_update(view(gw), view(gtotal), view(gsnapshot), ranks, stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(gw.cpu(), w + total / ranks - snapshot, rtol=1e-6, atol=1e-6)
    bagua_core._testing.cuda_divide_inplace(view(gw), 3, stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(gw.cpu(), (w + total / ranks - snapshot) / 3, rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_async_drift_reduction_matches_the_formula(dtype):
    n, ranks = 100_003, 3  # not a multiple of the block size
    g = torch.Generator().manual_seed(3)
    total, snapshot = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    out = torch.zeros(2, dtype=torch.float64, device="cuda")
    gtotal, gsnapshot = total.cuda(), snapshot.cuda()  # held: see test_async_update_and_divide...
    bagua_core._testing.cuda_async_average_drift(view(gtotal), view(gsnapshot), ranks, view(out), stream())
    torch.cuda.synchronize()
    mean = total.double() / ranks
    expected = torch.stack([((snapshot.double() - mean) ** 2).sum(), (mean ** 2).sum()])
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-9, atol=1e-9)


def test_kernel_calls_fail_cleanly_without_a_gpu():
    """Runs everywhere: a host tensor is refused, and without a device a
    kernel call is an exception, never a crash."""
    with pytest.raises(bagua_core.InvalidArgumentError):
        bagua_core._testing.cuda_divide_inplace(bagua_core.TensorView(0, 4, "float32", "cpu"), 2)
    host = bagua_core.TensorView(0, 4, "float32", "cpu")
    with pytest.raises(bagua_core.InvalidArgumentError):
        bagua_core._testing.cuda_async_average_drift(host, host, 2, bagua_core.TensorView(0, 2, "float64", "cpu"))
    if not HAVE_GPU:
        with pytest.raises(bagua_core.BaguaError):
            bagua_core._testing.cuda_divide_inplace(bagua_core.TensorView(0, 4, "float32", "cuda:0"), 2)


@gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("rows,cols,rank,with_error", [(37, 23, 1, True), (300, 5000, 2, True), (2048, 64, 5, False),
                                                       (1, 17, 2, True), (70, 1, 1, True)])
def test_low_rank_step_on_cuda_matches_the_cpu(dtype, tolerance, rows, cols, rank, with_error):
    """PowerSGD's matrix kernels (kernels/low_rank_kernels.cu) against the
    host loops: the same formulas, sums in another order."""
    g = torch.Generator().manual_seed(rows + cols + rank)
    cpu = [torch.randn(rows, cols, generator=g).to(dtype), torch.randn(rows, cols, generator=g).to(dtype),
           torch.randn(cols, rank, generator=g).to(dtype), torch.zeros(rows, rank, dtype=dtype)]
    if not with_error:
        cpu[1] = torch.empty(0, dtype=dtype)
    gpu_tensors = [t.cuda() for t in cpu]  # held: a view does not keep its tensor alive
    bagua_core.low_rank_step(*(view(t) for t in cpu), rows, cols, rank)
    bagua_core.low_rank_step(*(view(t) for t in gpu_tensors), rows, cols, rank)
    for name, a, b in zip(("m", "error", "q", "p"), cpu, gpu_tensors):
        scale = max(1.0, a.double().abs().max().item()) if a.numel() else 1.0
        torch.testing.assert_close(b.cpu().double(), a.double(), rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda m: f"{name}: {m}")


def _world_of_one(prefix):
    return bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix=prefix)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("op", OPS)
def test_bucket_ops_on_cuda_equal_the_cpu_path(dtype, op):
    """The same op on a CPU bucket and a CUDA bucket (ready events, kernels on
    the communication stream, staged Gloo) gives the same bytes, world of one."""
    data = (torch.randn(70001, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)
    cpu_steps, cpu_extra = run_bucket_op("cpu", data, op, _world_of_one("op-cpu"))
    gpu_steps, gpu_extra = run_bucket_op("cuda", data, op, _world_of_one("op-cuda"))
    for cpu, gpu_result in zip(cpu_steps + cpu_extra, gpu_steps + gpu_extra):
        assert torch.equal(cpu, gpu_result)


@gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_ops_on_cuda_equal_the_cpu_path_across_processes(tmp_path, world_size):
    """At world 1 the scatter-gather, ring and compression exchanges return
    early, so their kernels (chunked reduce, axpby, divide, per-peer
    decompress) only run here: several processes share the GPU over
    host-staged Gloo, each runs every op on a CPU and a CUDA bucket with its
    own data, and the two give the same bytes on every rank."""
    results = run_workers("bucket_ops", world_size, tmp_path, script=GPU_WORKERS, timeout=300)
    for rank, per_op in enumerate(results):
        assert sorted(per_op) == sorted(f"{op}-{dtype}" for op in OPS for dtype in ("float32", "float16"))
        for key, (cpu, gpu_result) in per_op.items():
            for step, (c, g) in enumerate(zip(cpu, gpu_result)):
                assert torch.equal(c, g), (f"rank {rank}, {key}, result {step}: max difference "
                                           f"{(c.double() - g.double()).abs().max().item()}")
    # the centralized ops end equal on every rank
    for key in results[0]:
        if key.startswith("c_"):
            for rank in range(1, world_size):
                assert torch.equal(results[rank][key][1][-1], results[0][key][1][-1]), key


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product"])
def test_pairwise_reduce_matches_the_cpu_bit_for_bit(dtype, op):
    """The NCCL P-Reduce's ring step (kernels/reduce_kernels.cu): torch's CPU
    ops compute 16-bit values in float and round once, as ours do."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(70_001, generator=g) * 4).to(dtype)
    b = (torch.randn(70_001, generator=g) * 4).to(dtype)
    reference = {"sum": torch.add, "avg": torch.add, "min": torch.minimum, "max": torch.maximum,
                 "product": torch.mul}[op](a, b)
    ga, gb = a.cuda(), b.cuda()
    out = torch.empty_like(ga)
    bagua_core._testing.cuda_pairwise_reduce(op, view(out), view(ga), view(gb), stream())
    bagua_core._testing.cuda_pairwise_reduce(op, view(gb), view(ga), view(gb), stream())  # in place
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference)
    assert torch.equal(gb.cpu(), reference)


@gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_partial_allreduce_of_cuda_tensors_equals_the_cpu_across_processes(tmp_path, world_size):
    """P-Reduces of CUDA tensors over host-staged Gloo (processes sharing the
    GPU; NCCL refuses two ranks on one device): the same bits as the same
    calls on host tensors, members bit-identical, a rank alone untouched."""
    results = run_workers("partial_allreduce", world_size, tmp_path, script=GPU_WORKERS, timeout=300)
    for rank, runs in enumerate(results):
        for key, (cpu, gpu_result) in runs.items():
            assert torch.equal(cpu, gpu_result), (rank, key)
    for key in results[0]:
        if key.startswith("world"):
            assert all(torch.equal(r[key][0], results[0][key][0]) for r in results), key
        else:  # ranks 0 and world-1 average, the others keep their data
            assert torch.equal(results[0][key][0], results[-1][key][0]), key
            for r in results[1:-1]:
                assert not torch.equal(r[key][0], results[0][key][0]), key


@gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_bluefog_windows_on_cuda_tensors_equal_host_windows(tmp_path, world_size):
    """Host-staged CUDA windows: the same calls give the same bits as on
    host tensors, on every rank (processes sharing the GPU)."""
    results = run_workers("bluefog_windows", world_size, tmp_path, script=GPU_WORKERS, timeout=300)
    for rank, per_device in enumerate(results):
        assert len(per_device["cuda"]) == len(per_device["cpu"]) == 6
        for step, (c, g) in enumerate(zip(per_device["cpu"], per_device["cuda"])):
            assert torch.equal(c, g), (rank, step)


@gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_bluefog_ops_on_cuda_tensors_equal_host_tensors(tmp_path, world_size):
    """BlueFog's neighbour ops and collectives on CUDA tensors (host-staged
    Gloo, processes sharing the GPU) give the bits of the same calls on host
    tensors, on every rank."""
    results = run_workers("bluefog_ops", world_size, tmp_path, script=GPU_WORKERS, timeout=300)
    for rank, per_device in enumerate(results):
        assert per_device["cpu"].keys() == per_device["cuda"].keys()
        for call, host in per_device["cpu"].items():
            assert torch.equal(host, per_device["cuda"][call]), (rank, call)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bluefog_ops_scenario_runs_on_the_cpu(tmp_path, world_size):
    """The GPU test's scenario on host tensors against BlueFog's closed forms:
    x_r = 0.001 i + r, y_r = j + 10 r; the exponential graph links every pair
    at 2 and 3 ranks, so the static average is the mean over ranks."""
    results = run_workers("bluefog_ops", world_size, tmp_path, script=GPU_WORKERS, args=("cpu",))
    n = world_size
    base_x = torch.arange(1000, dtype=torch.float64) * 0.001
    base_y = torch.arange(600, dtype=torch.float32).reshape(200, 3)
    mean_rank = (n - 1) / 2
    for rank, r in enumerate(results):
        out, pattern = r["cpu"], r["pattern"]
        assert torch.allclose(out["static"], base_x + mean_rank)
        assert pattern["send"] == [(rank + 1) % n] and pattern["recv"] == [(rank - 1) % n]
        assert torch.allclose(out["dynamic"], base_x + 0.5 * rank + 0.5 * ((rank - 1) % n))
        for k in range(3):
            assert torch.allclose(out[f"fused{k}"], (k + 1) * (base_x + mean_rank))
        assert torch.equal(out["allgather_neighbors"],
                           torch.cat([base_y + 10 * j for j in pattern["in_neighbors"]]))
        partner = rank ^ 1 if rank ^ 1 < n else rank  # the odd rank out keeps its x
        assert torch.allclose(out["pair_gossip"], base_x + (partner + rank) / 2)
        assert torch.allclose(out["allreduce"], base_y + 10 * mean_rank)
        assert torch.equal(out["broadcast"], base_x)
        assert torch.equal(out["allgather"], torch.cat([base_y + 10 * j for j in range(n)]))
        assert torch.allclose(out["allreduce_"], n * base_y + 10 * n * mean_rank)


@gpu
def test_event_pool_and_scratch_pool_are_reused_across_iterations():
    """After the first iteration no new events are created (the pool
    recycles them)."""
    comm = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix="pool")
    flat_buffer = torch.randn(4000, device="cuda")
    tensors = [flat_buffer[i * 1000:(i + 1) * 1000] for i in range(4)]  # a flattened bucket
    bucket = bagua_core.Bucket("b", [(f"t{i}", view(t)) for i, t in enumerate(tensors)])
    bucket.append_centralized_synchronous_op(comm.new_bucket_group([0]), None,
                                            bagua_core.CentralizedSynchronousOptions(hierarchical=False))
    backend = bagua_core.Backend(0, 30.0)
    backend.register_ordered_buckets([bucket])
    flat = torch.cat(tensors)
    created = []
    for _ in range(5):
        for i in range(4):
            backend.mark_communication_ready(f"t{i}", cuda_stream=stream())
        backend.wait_pending_comm_ops()
        created.append(bagua_core._testing.cuda_event_pool_created(0))
    assert created[-1] == created[0]
    assert torch.equal(torch.cat(tensors).cpu(), flat.cpu())
    stats = bagua_core._testing.scratch_pool_stats(0)
    assert stats["blocks_in_use"] == 0


def test_pool_statistics_are_reachable_without_a_gpu():
    """The pinned staging pool exists on every build (ordinary memory without
    CUDA); the device pools need a device and say so."""
    stats = bagua_core._testing.scratch_pool_stats(-1)
    assert set(stats) == {"blocks_in_use", "bytes_in_use", "blocks_cached", "bytes_cached",
                          "system_allocations", "cache_hits"}
    if not HAVE_GPU:
        with pytest.raises(ValueError, match="CUDA device 0"):
            bagua_core._testing.scratch_pool_stats(0)


@pytest.mark.parametrize("op", ["c_lp_s", "c_fp_s_scattergather", "d_fp_s_ring"])
def test_bucket_op_harness_runs_on_the_cpu(op):
    """The harness of the CPU-vs-CUDA comparison, on the CPU alone, so the
    GPU test's setup is known to work before it meets a GPU."""
    data = torch.linspace(-3, 5, 1001)
    steps, extra = run_bucket_op("cpu", data, op, _world_of_one(f"harness-{op}"))
    expected = data.clone()
    for result in steps:
        expected = expected * 1.5 + 0.25
        # world of one: full precision is exact, MinMaxUInt8 within its bound
        tolerance = 0 if op != "c_lp_s" else float(expected.max() - expected.min()) / 255
        assert float((result - expected).abs().max()) <= tolerance + 1e-6
        expected = result
    if op == "d_fp_s_ring":
        assert torch.equal(extra[0], steps[-1])


def test_bucket_op_harness_runs_across_cpu_processes(tmp_path):
    """The multi-process worker of the GPU comparison, CPU buckets only: the
    scenario itself is known to work where no GPU is."""
    results = run_workers("bucket_ops", 2, tmp_path, script=GPU_WORKERS, args=("cpu",))
    for per_op in results:
        for key, (cpu, _) in per_op.items():
            assert len(cpu) >= 3 and all(torch.isfinite(t.float()).all() for t in cpu), key


def _async_world_of_one(device):
    """World of one: every round adds sum/1 - snapshot = 0, so the weights
    must be exactly what training wrote, with rounds running between the
    (stream-ordered, on CUDA) lock/unlock calls."""
    import time
    comm = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix=f"async-{device}")
    weights = torch.zeros(10000, device=device)
    bucket = bagua_core.Bucket("w", [("w0", view(weights))])
    op = bucket.append_asynchronous_model_average_op(comm.new_group([0]),
                                                   bagua_core.AsyncModelAverageOptions(sync_interval_ms=1))
    backend = bagua_core.Backend(0, 30.0)
    backend.register_ordered_buckets([bucket])
    on_stream = {} if device == "cpu" else {"cuda_stream": stream()}
    backend.mark_communication_ready("w0", **on_stream)
    backend.wait_pending_comm_ops()  # starts the background rounds
    for _ in range(50):
        op.lock_weight(**on_stream)
        weights.add_(1.0)  # "training" on the current stream
        op.unlock_weight(**on_stream)
        time.sleep(0.002)
    op.abort()
    if device != "cpu":
        torch.cuda.synchronize()
    assert op.completed_rounds > 0
    assert torch.equal(weights.cpu(), torch.full((10000,), 50.0))


def test_bluefog_windows_scenario_runs_on_the_cpu(tmp_path):
    """The GPU test's window scenario on host tensors, against BlueFog's
    closed forms (x_r = r + 0.001 i, uniform weights over the in-neighbours
    of the exponential graph, here the one other rank)."""
    results = run_workers("bluefog_windows", 2, tmp_path, script=GPU_WORKERS, args=("cpu",))
    base = torch.arange(1000, dtype=torch.float64) * 0.001
    mean = base + 0.5  # the average of ranks 0 and 1
    for rank, per_device in enumerate(results):
        steps = per_device["cpu"]
        assert torch.allclose(steps[0], mean)                      # put, then update
        assert torch.allclose(steps[1], mean * 0.5)                # accumulate's self weight
        # the buffer: the put (mean), plus the accumulated mean, replaced by
        # the get of the other rank's scaled tensor (mean / 2)
        assert torch.allclose(steps[2], (mean * 0.5 + mean * 0.5) / 2)
        assert torch.equal(steps[3], steps[1])                     # the clone left x alone
    assert float(results[0]["cpu"][5]) == float(results[1]["cpu"][5])


def test_async_model_average_world_of_one_on_the_cpu():
    _async_world_of_one("cpu")


@gpu
def test_async_model_average_on_cuda_weights_keeps_training_progress():
    _async_world_of_one("cuda")


@gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_copy_back_peer_weight_is_ordered_on_the_callers_stream(side_stream):
    """copy_back_peer_weight(bucket, cuda_stream): the copy comes after the
    kernels already on the caller's stream and before the ones enqueued after
    it, with no host wait in between."""
    comm = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix=f"copy-back-{side_stream}")
    n = 1 << 20
    weights = torch.zeros(n, device="cuda")
    peer = torch.arange(n, dtype=torch.float32, device="cuda")
    bucket = bagua_core.Bucket("w", [("w0", view(weights))])
    op = bucket.append_decentralized_synchronous_op(
        comm.new_bucket_group([0]), None, view(peer), bagua_core.DecentralizedSynchronousOptions(hierarchical=False))
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream() if side_stream else torch.cuda.default_stream()):
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            big = big @ big / 2048  # keeps the stream busy before the write below
        weights.fill_(-1.0)
        op.copy_back_peer_weight(bucket, cuda_stream=stream())
        doubled = weights * 2
        result = doubled.cpu()
    assert torch.equal(result, torch.arange(n, dtype=torch.float32) * 2)
