"""MinMaxUInt8 through the Python module: same codes as an independent
reference, the documented byte layout, the NaN/Inf and constant-chunk rules,
the error bound; and bad input for the low-precision algorithms and for the
host compressor (CUDA views)."""

import struct
import subprocess
import sys

import pytest
import torch

import bagua_core
import bagua.torch_api as bagua
from bagua.torch_api._core import tensor_view
from bagua.torch_api.algorithms import bytegrad, decentralized, q_adam
import minmax_reference as ref


def compress(x):
    out = torch.zeros(bagua_core._testing.minmax_uint8_compressed_bytes(x.numel()), dtype=torch.uint8)
    bagua_core._testing.minmax_uint8_compress(tensor_view(x), tensor_view(out))
    return out


def decompress(packed, like):
    out = torch.zeros_like(like)
    bagua_core._testing.minmax_uint8_decompress(tensor_view(packed), tensor_view(out))
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3, 255, 1000, 4097])
@pytest.mark.parametrize("scale,offset", [(1e-3, 0.0), (1.0, 0.0), (37.0, 5.0), (1e3, -100.0)])
def test_codes_equal_the_reference_and_error_is_bounded(n, scale, offset):
    g = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=g) * 2 - 1) * scale + offset
    packed = compress(x)
    lo, hi = struct.unpack("=ff", packed[:8].numpy().tobytes()) if n else (0.0, 0.0)
    r_lo, r_hi, r_codes = ref.compress(x)
    if n:
        assert (lo, hi) == (float(r_lo), float(r_hi))
    assert torch.equal(packed[8:], r_codes)
    y = decompress(packed, x)
    assert torch.equal(y, ref.decompress(r_lo, r_hi, r_codes))
    if n:
        bound = (hi - lo) / 255 / 2 + 4 * x.abs().max().item() * 2 ** -24 + 1e-7
        assert (y - x).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_compress(dtype):
    x = torch.linspace(-3, 5, 999).to(dtype)
    y = decompress(compress(x), x)
    storage = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8, torch.float64: 2 ** -24}[dtype]
    assert (y.double() - x.double()).abs().max().item() <= 8 / 510 + 5 * storage + 1e-6


def test_constant_chunks_are_exact_and_non_finite_chunks_decode_to_nan():
    x = torch.full((10,), 2.5)
    assert torch.equal(decompress(compress(x), x), x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.tensor([1.0, bad, 3.0])
        packed = compress(x)
        assert all(v != v for v in struct.unpack("=ff", packed[:8].numpy().tobytes()))
        assert torch.isnan(decompress(packed, x)).all()


def test_integer_tensors_are_refused():
    x = torch.arange(5, dtype=torch.int32)
    with pytest.raises(bagua.InvalidArgumentError, match="floating point"):
        compress(x)


def test_low_precision_algorithm_arguments_are_checked():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(bagua.InvalidArgumentError, match="warmup_steps"):
        q_adam.QAdamOptimizer(model.parameters(), warmup_steps=0)
    with pytest.raises(bagua.InvalidArgumentError, match="warmup_steps"):
        q_adam.QAdamOptimizer(model.parameters(), warmup_steps=-5)
    with pytest.raises(bagua.InvalidArgumentError, match="betas"):
        q_adam.QAdamOptimizer(model.parameters(), betas=(1.5, 0.9))
    with pytest.raises(bagua.InvalidArgumentError, match="QAdamOptimizer"):
        q_adam.QAdamAlgorithm(torch.optim.Adam(model.parameters()))
    with pytest.raises(bagua.InvalidArgumentError, match="communication_interval"):
        decentralized.LowPrecisionDecentralizedAlgorithm(communication_interval=0)
    with pytest.raises(bagua.InvalidArgumentError, match="hierarchical"):
        bytegrad.ByteGradAlgorithm(hierarchical="no")


def test_the_host_compressor_rejects_cuda_views():
    # A CUDA pointer read on the host is a crash: in a child process, so that
    # a regression fails this test instead of killing the run.
    code = """
import bagua_core
t = bagua_core._testing

fake_gpu = 0x7f0000000000  # not host memory: must never be dereferenced
calls = {
    "compress(cuda input)": lambda: t.minmax_uint8_compress(
        bagua_core.TensorView(fake_gpu, 16, "float32", "cuda:0"),
        bagua_core.TensorView(fake_gpu, 24, "uint8", "cpu")),
    "compress(cuda output)": lambda: t.minmax_uint8_compress(
        bagua_core.TensorView(fake_gpu, 16, "float32", "cpu"),
        bagua_core.TensorView(fake_gpu, 24, "uint8", "cuda:0")),
    "decompress(cuda input)": lambda: t.minmax_uint8_decompress(
        bagua_core.TensorView(fake_gpu, 24, "uint8", "cuda:0"),
        bagua_core.TensorView(fake_gpu, 16, "float32", "cpu")),
    "decompress(cuda output)": lambda: t.minmax_uint8_decompress(
        bagua_core.TensorView(fake_gpu, 24, "uint8", "cpu"),
        bagua_core.TensorView(fake_gpu, 16, "float32", "cuda:1")),
}
for name, call in calls.items():
    try:
        call()
    except bagua_core.InvalidArgumentError as e:
        assert "cuda" in str(e) and "host" in str(e), (name, str(e))
        print("rejected", name)
    else:
        raise SystemExit(f"{name} was accepted")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.count("rejected") == 4, proc.stdout
