"""Matmuls on Intel AMX tiles (amx.c, amx_q4.c, amx_q4_codes.c, amx_q8.c): int4 linears and
the int8 LM head.

Built like the other CPU kernels (`cpu._build`, cached by source hash) but as its
own library, only on CPUs with AMX-BF16 (Sapphire Rapids and later): `available()` is False
elsewhere (AMD, older Intel, AVX2-only machines) and callers keep torch's kernel. Linux gives
a process the AMX tile state only on request; loading the library asks for it, and a kernel
that refuses (an old kernel, a hypervisor that hides it) leaves AMX unavailable.
`SGLANG_LIKE_CPU_KERNELS=off` turns it off with the other native kernels, `SGLANG_LIKE_AMX=off`
alone (read once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from sglang_like_kernels.cpu import _build, _cpu_flags, _requested, lend_tiles

logger = logging.getLogger(__name__)

__all__ = ["available", "kq_matmul", "q4_matmul", "q4_x16_matmul",
           "q8_matmul", "q8_x16_matmul"]

# q4_1.c for its activation quantizer: amx_kq.c rounds activations exactly as the x16 kernel
_SOURCES = ("amx.c", "amx_q4.c", "amx_q4_codes.c", "amx_q8.c", "amx_q8x16.c", "amx_kq.c",
            "amx_attn.c", "q4_1.c")
_HEADERS = ("amx.h", "simd.h", "kquants.h")
_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"]
_CPU_FLAGS = {"amx_tile", "amx_bf16", "amx_int8", "avx512_vnni", "avx512f", "avx512bw",
              "avx512vl", "avx512_bf16"}


def cpu_supports() -> bool:
    return _CPU_FLAGS <= _cpu_flags()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    amx = os.environ.get("SGLANG_LIKE_AMX", "").strip().lower() or "auto"
    if amx not in ("auto", "off"):
        raise ValueError(f"SGLANG_LIKE_AMX={amx!r}: expected auto or off")
    if amx == "off" or _requested() == "off" or not cpu_supports():
        return None
    try:
        here = Path(__file__).parent
        lib = ctypes.CDLL(str(_build("amx_bf16", [here / s for s in _SOURCES], _FLAGS,
                                     tuple(here / h for h in _HEADERS))))
    except (RuntimeError, OSError) as exc:
        logger.warning("AMX kernels unavailable, using torch's: %s", exc)
        return None
    lib.amx_init.restype = ctypes.c_int
    if lib.amx_init() != 0:
        logger.warning("the OS refused this process AMX tile state; using torch's kernels")
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_amx_matmul.argtypes = [p, p, i64, i64, i64, p, i64, i64, p, i64]
    lib.q4_amx_matmul.restype = ctypes.c_int
    lib.q4_amx_matmul_codes.argtypes = lib.q4_amx_matmul.argtypes
    lib.q4_amx_matmul_codes.restype = ctypes.c_int
    lib.q8_amx_matmul.argtypes = [p, p, i64, i64, p, i64, i64, p, i64]
    lib.q8_amx_matmul.restype = ctypes.c_int
    lib.q8_amx_matmul_i8.argtypes = lib.q8_amx_matmul.argtypes
    lib.q8_amx_matmul_i8.restype = ctypes.c_int
    lib.q8_x16_amx_matmul.argtypes = lib.q8_amx_matmul.argtypes
    lib.q8_x16_amx_matmul.restype = ctypes.c_int
    lib.kq_amx_matmul.argtypes = [ctypes.c_int, p, i64, i64, p, i64, i64, p, i64]
    lib.kq_amx_matmul.restype = ctypes.c_int
    lend_tiles(*(ctypes.cast(fn, ctypes.c_void_p).value
                 for fn in (lib.kq_amx_group, lib.attn_amx_shared,
                           lib.q8_x16_amx_hi_pass)))
    return lib


def available() -> bool:
    return _library() is not None


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("AMX kernels are unavailable on this machine")
    return lib


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the kernels read it: `dtype` with contiguous rows (a row stride is allowed)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


Q4_KERNELS = ("codes", "bf16")


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor,
              group_size: int, kernel: str = "bf16") -> torch.Tensor:
    """x [M, K] bf16 @ W.T -> [M, N] bf16, W held as torch packs it for
    `_weight_int4pack_mm_for_cpu` on AVX-512: `codes` uint8 [N, K/2] in 64-row blocks
    (quant/int4.py `_unpack_blocked`), `scale_zero` bf16 [K/group, N, 2]. `kernel`: "codes"
    (amx_q4_codes.c: a row's result the same bits in any batch; decode, verifies, short
    prompts) or "bf16" (amx_q4.c: weights dequantized once per call; prefill chunks)."""
    if kernel not in Q4_KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {Q4_KERNELS}")
    x = _rows(x, torch.bfloat16)
    (m, k), n = x.shape, codes.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        lib = _lib()
        fn = lib.q4_amx_matmul_codes if kernel == "codes" else lib.q4_amx_matmul
        if fn(codes.data_ptr(), scale_zero.data_ptr(), n, k, group_size, x.data_ptr(),
              x.stride(0), m, y.data_ptr(), n) != 0:
            raise RuntimeError(f"q4_amx_matmul: N={n} must divide by 64, K={k} and group "
                               f"{group_size} by 32")
    return y


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              int8: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32 with W = codes int8 [N, K] times scales
    float32 [N, K/32] (cpu.q8_0_matmul_f32's operands). `int8`: the integer kernel,
    else the bf16 one (amx_q8.c)."""
    x = _rows(x, torch.float32)
    (m, k), n = x.shape, codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib = _lib()
    fn = lib.q8_amx_matmul_i8 if int8 else lib.q8_amx_matmul
    if m and fn(codes.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(), x.stride(0), m,
                y.data_ptr(), n) != 0:
        raise RuntimeError(f"q8_amx_matmul: N={n} and K={k} must divide by 32")
    return y


def q4_x16_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W in the x16 layout (`cpu.q4_x16_pack`;
    N = out_features, a multiple of 16; K a multiple of 32), on AMX-INT8 tiles (amx_kq.c, whose
    Q4_K kind is the x16 record byte for byte):
    the same bits as `cpu.q4_x16_matmul`, row for row, at any M."""
    x = _rows(x, torch.float32)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m and _lib().kq_amx_matmul(-1, packed.data_ptr(), out_features, k, x.data_ptr(),
                                  x.stride(0), m, y.data_ptr(), out_features) != 0:
        raise RuntimeError(f"q4_x16_amx_matmul: N={out_features} must divide by 16, K={k} "
                           "by 32")
    return y


def q8_x16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W in the q8 x16 layout (`cpu.q8_x16_pack`:
    codes int8 [N/16, K/32, 8, 16, 4], scales float32 [N/16, K/32, 16]), on AMX-INT8 tiles
    (amx_q8x16.c): the same bits as `cpu.q8_x16_matmul`, row for row, at any M."""
    x = _rows(x, torch.float32)
    m, k = x.shape
    n = packed.shape[0] * 16
    y = torch.empty(m, n, dtype=torch.float32)
    if m and _lib().q8_x16_amx_matmul(packed.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(),
                                      x.stride(0), m, y.data_ptr(), n) != 0:
        raise RuntimeError(f"q8_x16_amx_matmul: N={n} must divide by 16, K={k} by 32")
    return y


def kq_matmul(x: torch.Tensor, packed: torch.Tensor, kind: int, out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W packed as kquants.c's `kind` (its code in
    `cpu.KQ_KINDS`; -1: the x16 Q4_1 layout), on AMX-INT8 tiles (amx_kq.c): the same bits as
    `cpu.kq_matmul` (and, for -1, `cpu.q4_x16_matmul`) on AVX-512 VNNI, row for row, at any M."""
    x = _rows(x, torch.float32)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m and _lib().kq_amx_matmul(kind, packed.data_ptr(), out_features, k, x.data_ptr(),
                                  x.stride(0), m, y.data_ptr(), out_features) != 0:
        raise RuntimeError(f"kq_amx_matmul: kind {kind}, N={out_features} must divide by 16, "
                           f"K={k} by 32")
    return y

