"""CUDA kernels against the CPU path. These run only where a GPU is present;
elsewhere every test is skipped with the reason."""

import pytest
import torch

import bagua_core

HAVE_GPU = bagua_core.cuda_compiled() and bagua_core.cuda_device_count() > 0 and torch.cuda.is_available()
gpu = pytest.mark.skipif(
    not HAVE_GPU,
    reason=("no usable CUDA device (bagua built with CUDA: %s, devices: %d, torch.cuda: %s); "
            "the GPU checks run on a GPU machine" % (bagua_core.cuda_compiled(), bagua_core.cuda_device_count(),
                                                     torch.cuda.is_available())))

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
         torch.float64: "float64", torch.int32: "int32"}


def view(t):
    device = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"
    return bagua_core.TensorView(t.data_ptr(), t.numel(), NAMES[t.dtype], device)


def stream():
    return torch.cuda.current_stream().cuda_stream


def cpu_compress_chunks(x, chunk):
    parts = []
    for begin in range(0, x.numel(), chunk):
        part = x[begin:begin + chunk].contiguous()
        out = torch.zeros(bagua_core.minmax_uint8_compressed_bytes(part.numel()), dtype=torch.uint8)
        bagua_core.minmax_uint8_compress(view(part), view(out))
        parts.append(out)
    return torch.cat(parts)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 1000), (4097, 1024), (1 << 20, 1 << 16)])
def test_compression_codes_equal_the_cpu_bit_for_bit(dtype, n, chunk):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1).to(dtype)
    expected = cpu_compress_chunks(x, chunk)
    gpu_x = x.cuda()
    out = torch.zeros(expected.numel(), dtype=torch.uint8, device="cuda")
    bagua_core.cuda_minmax_uint8_compress(view(gpu_x), chunk, out.data_ptr(), stream())
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    decoded = torch.zeros_like(gpu_x)
    bagua_core.cuda_minmax_uint8_decompress(out.data_ptr(), chunk, view(decoded), False, stream())
    cpu_decoded = torch.cat([_cpu_decompress(p, x[b:b + chunk]) for b, p in _chunks(expected, x, chunk)])
    torch.cuda.synchronize()
    assert torch.equal(decoded.cpu(), cpu_decoded)


def _chunks(packed, x, chunk):
    offset = 0
    for begin in range(0, x.numel(), chunk):
        size = min(chunk, x.numel() - begin)
        yield begin, packed[offset:offset + 8 + size]
        offset += 8 + size


def _cpu_decompress(packed, like):
    out = torch.zeros_like(like)
    bagua_core.minmax_uint8_decompress(view(packed), view(out))
    return out


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("mean", [False, True])
def test_chunked_reduce_matches_the_cpu(dtype, mean):
    chunks, n = 5, 100_003
    x = (torch.randn(chunks * n, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    out = torch.zeros(n, dtype=dtype, device="cuda")
    bagua_core.cuda_chunked_reduce(view(x.cuda()), chunks, view(out), mean, stream())
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
    gw = w.cuda()
    bagua_core.cuda_async_average_update(view(gw), view(total.cuda()), view(snapshot.cuda()), ranks, stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(gw.cpu(), w + total / ranks - snapshot, rtol=1e-6, atol=1e-6)
    bagua_core.cuda_divide_inplace(view(gw), 3, stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(gw.cpu(), (w + total / ranks - snapshot) / 3, rtol=1e-6, atol=1e-6)


def test_kernel_calls_fail_cleanly_without_a_gpu():
    """Runs everywhere: a host tensor is refused, and without a device a
    kernel call is an exception, never a crash."""
    with pytest.raises(bagua_core.InvalidArgumentError):
        bagua_core.cuda_divide_inplace(bagua_core.TensorView(0, 4, "float32", "cpu"), 2)
    if not HAVE_GPU:
        with pytest.raises(bagua_core.BaguaError):
            bagua_core.cuda_divide_inplace(bagua_core.TensorView(0, 4, "float32", "cuda:0"), 2)
