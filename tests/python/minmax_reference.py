"""A pure-Python (torch float32) reference of MinMaxUInt8, written from the
formulas in docs/compression.md, independent of the C++ code."""

import torch

F32 = torch.float32


def compress(x: torch.Tensor):
    """(min, max, codes) of a 1-D float tensor, computed in float32."""
    x = x.to(F32)
    if x.numel() == 0:
        return torch.tensor(0.0), torch.tensor(0.0), torch.zeros(0, dtype=torch.uint8)
    if not torch.isfinite(x).all():
        nan = torch.tensor(float("nan"))
        return nan, nan, torch.zeros(x.numel(), dtype=torch.uint8)
    lo, hi = x.min(), x.max()
    if lo == hi:
        return lo, hi, torch.zeros(x.numel(), dtype=torch.uint8)
    scale = torch.tensor(255.0, dtype=F32) / (hi - lo + torch.tensor(1e-7, dtype=F32))
    upper = torch.round(hi * scale)
    lower = upper - 255
    codes = torch.clamp(torch.round(x * scale) - lower, 0, 255).to(torch.uint8)
    return lo, hi, codes


def decompress(lo, hi, codes):
    if torch.isnan(lo):
        return torch.full((codes.numel(),), float("nan"))
    if lo == hi:
        return torch.full((codes.numel(),), float(lo))
    scale = torch.tensor(255.0, dtype=F32) / (hi - lo + torch.tensor(1e-7, dtype=F32))
    lower = torch.round(hi * scale) - 255
    return (codes.to(F32) + lower) / scale


def roundtrip_chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Q^-1(Q(x)) with a min/max per chunk of `chunk` elements."""
    out = torch.empty_like(x, dtype=F32)
    for begin in range(0, x.numel(), chunk):
        part = x[begin:begin + chunk]
        out[begin:begin + chunk] = decompress(*compress(part))
    return out
