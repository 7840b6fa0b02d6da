"""Quantized KV pools: 8-bit codes per element, one float32 scale per (slot, kv head).

A quantized layer's pool is a pair: codes [S, Hkv, D] in the pool dtype (``torch.int8``,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) and scales [S, Hkv] float32 beside it. A
stored row x [D] (one token's one kv head) is first rotated, r = W S x (``rotate``: S flips
the signs of a fixed pseudo-random half of the channels, ``signs``; W is the Walsh-Hadamard
transform in blocks of B = the largest power of two dividing D, unnormalized), then becomes

    scale = max|r| / QMAX          (QMAX 127 for int8, 448 for e4m3, 57344 for e5m2)
    code  = round(r / scale)       (int8: to nearest, ties to even, in [-127, 127];
                                    fp8: torch's float -> fp8 cast, the same rounding)

and holds S W (code * scale) / B (W W = B I, S S = I). Why the rotation: a head's K rows
carry a few outlier channels (RoPE pairs with large norms), and one scale per row then spends
the code range on them; the rotation spreads every channel over all B, so the codes fit the
row. The signs break the alignment of structured rows with W's own rows (a pair of outliers
whose signs match a Hadamard pattern would land in a few outputs). Attention never rotates
the keys back: q . k = (W S q / B) . (W S k), and sum p_i v_i = S W (sum p_i W S v_i) / B, so
every attention (the torch references, Triton, the native kernels) rotates its query once and
its output once (query_for / output_for), and reads the rows as stored, code * scale. The
default model's teacher-forced top-1 agreement with a bf16 pool, float32 activations:
docs/benchmarks.md#bench_kv_dtype.

The scale is per row so a token's keys use the whole code range whatever their magnitude (a
K row after RoPE and a V row differ by orders of magnitude between heads and layers); fp8
takes the same scale so its few mantissa bits are never spent in the subnormal range.

The native CPU kernels (cpu/attention.c) compute the same rotation (the same butterflies in
the same order: exact float32 sums and differences) and the same codes and scales bit for
bit (float32 division, round to nearest even), so a pool written by either path reads the
same.
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "QUANTIZED_DTYPES", "as_bytes", "block", "dequantize", "is_quantized",
           "output_for", "query_for", "quantize", "quantize_rotated", "rotate", "rotate_back",
           "rotated_values", "signs"]

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANTIZED_DTYPES = tuple(QMAX)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def block(d: int) -> int:
    """The rotation's block: the largest power of two dividing the head size."""
    return d & -d


def _sign_flipped(j: int) -> bool:
    """Whether channel j's sign is flipped: the top bit of a 32-bit integer hash of j (the
    same in cpu/attention.c's kv_sign_flipped), so the pattern is fixed for every head size
    and needs no table on disk or on the wire."""
    h = (j * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    return bool(h >> 31)


_SIGNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """S's diagonal for head size d: float32 [d] of +1 and -1."""
    key = (d, torch.device(device))
    s = _SIGNS.get(key)
    if s is None:
        s = torch.tensor([-1.0 if _sign_flipped(j) else 1.0 for j in range(d)], device=device)
        _SIGNS[key] = s
    return s


def rotate(x: torch.Tensor) -> torch.Tensor:
    """W S x along the last dim (float32): the signs flipped (exact), then the unnormalized
    Walsh-Hadamard transform of each block of `block(D)` values, by butterflies
    (a + b, a - b) of span 1, 2, 4, ... in the order cpu/attention.c's kv_rotate runs them,
    so both give the same bits."""
    shape, d = x.shape, x.shape[-1]
    x = x.float() * signs(d, x.device)
    b = block(d)
    h = 1
    while h < b:
        y = x.reshape(-1, d // (2 * h), 2, h)
        x = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(shape)


# row-vector matrices: x @ _FORWARD = W S x / B, r @ _INVERSE = S W r / B
_FORWARD: dict[tuple[int, torch.device], torch.Tensor] = {}
_INVERSE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _matrix(cache: dict, d: int, device: torch.device, inverse: bool) -> torch.Tensor:
    m = cache.get((d, device))
    if m is None:
        # rows of rotate(I) are W S e_j: as a right factor, x @ that = W S x (W symmetric)
        m = rotate(torch.eye(d, device=device)) / block(d)
        m = m.T.contiguous() if inverse else m
        cache[(d, device)] = m
    return m


def rotate_back(r: torch.Tensor) -> torch.Tensor:
    """x from r = W S x (float32): one matmul by S W / B. Readers take this (not the
    butterflies) for speed; its bits need not match anything."""
    return r.float() @ _matrix(_INVERSE, r.shape[-1], r.device, inverse=True)


def quantize_rotated(r: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows already rotated -> (codes, scales): one scale per row, max|r| / QMAX."""
    r = r.float()
    scale = r.abs().amax(dim=-1) / QMAX[dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = r / safe.unsqueeze(-1)
    if dtype == torch.int8:
        codes = y.round_().clamp_(-127.0, 127.0).to(torch.int8)
    else:
        codes = y.to(dtype)
    return codes, scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] of `dtype`, scales [...] float32) of
    its rotation (see the module doc)."""
    return quantize_rotated(rotate(x), dtype)


def rotated_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D], scales [...] -> float32 code * scale: the rows as stored, W S x."""
    return codes.float() * scale.unsqueeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D], scales [...] -> the float32 rows x [..., D] they hold (rotated back)."""
    return rotate_back(rotated_values(codes, scale))


def query_for(q: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """q as an attention over a pool of `pool_dtype` reads it: W S q / B over a quantized
    pool (its keys are W S k, and (W S q / B) . (W S k) = q . k), else q itself."""
    if not is_quantized(pool_dtype):
        return q
    return (q.float() @ _matrix(_FORWARD, q.shape[-1], q.device, inverse=False)).to(q.dtype)


def output_for(out: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """An attention's output over a pool of `pool_dtype`: over a quantized pool the sum of
    p_i W S v_i is W S o, so o = S W (W S o) / B; else the output itself."""
    return rotate_back(out).to(out.dtype) if is_quantized(pool_dtype) else out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (same storage): torch's CPU index_copy_ and several other ops
    have no float8 kernels, and copying codes never needs their values."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
