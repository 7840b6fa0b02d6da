"""Quantized KV pools: 8-bit codes per element, one float32 scale per (slot, kv head).

A quantized layer's pool is a pair: codes [S, Hkv, D] in the pool dtype (``torch.int8``,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) and scales [S, Hkv] float32 beside it. A
stored row x [D] (one token's one kv head) becomes

    scale = max|x| / QMAX          (QMAX 127 for int8, 448 for e4m3, 57344 for e5m2)
    code  = round(x / scale)       (int8: to nearest, ties to even, in [-127, 127];
                                    fp8: torch's float -> fp8 cast, the same rounding)

and is read back as code * scale. A row of zeros has scale 0 and codes 0. The scale is per
row so a token's keys use the whole code range whatever their magnitude (a K row after RoPE
and a V row differ by orders of magnitude between heads and layers); fp8 takes the same
scale so its few mantissa bits are never spent in the subnormal range.

The native CPU kernels (cpu/attention.c) compute the same codes and scales bit for bit
(float32 division, round to nearest even), so a pool written by either path reads the same.
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "QUANTIZED_DTYPES", "as_bytes", "dequantize", "is_quantized", "quantize"]

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANTIZED_DTYPES = tuple(QMAX)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] of `dtype`, scales [...] float32)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX[dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / safe.unsqueeze(-1)
    if dtype == torch.int8:
        codes = y.round_().clamp_(-127.0, 127.0).to(torch.int8)
    else:
        codes = y.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D], scales [...] -> float32 [..., D]."""
    return codes.float() * scale.unsqueeze(-1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (same storage): torch's CPU index_copy_ and several other ops
    have no float8 kernels, and copying codes never needs their values."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
