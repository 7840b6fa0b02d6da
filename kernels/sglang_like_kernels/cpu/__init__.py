"""Native CPU kernels (C with x86 intrinsics), built on first use with the system compiler.

`q4_1_matmul` multiplies activations by weights held in GGUF's Q4_1 blocks (the default
model's format) after quantizing each activation row to int8 per block of 32, as llama.cpp
does: the integer dot is a `vpdpbusd` (AVX-512 VNNI) or `vpmaddubsw` (AVX2). Built twice
from one source, one per instruction set; `isa()` is the variant this CPU runs, chosen at
run time. `SGLANG_LIKE_CPU_KERNELS` overrides it (read once): `auto` (default), `avx2`,
`avx512_vnni` or `off` (torch's kernels only).

Intel AMX kernels (int4 linears and the LM head for batches) are a library of their own:
`sglang_like_kernels.cpu.amx`, built only where the CPU has AMX.

The shared library goes to `$SGLANG_LIKE_CACHE_DIR/kernels` (default
`~/.cache/sglang_like/kernels`) under a name that hashes the source, the flags and the
compiler, so a second start loads it at once; a failed build (no compiler) leaves the
library unavailable and callers on torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["available", "isa", "kq_dequantize", "kq_matmul", "kq_rows", "kq_record_bytes",
           "q4_1_dequantize", "q4_1_matmul", "q4_x16_dequantize",
           "q4_x16_matmul", "q4_x16_pack", "q8_0_matmul_f32", "q8_x16_argmax", "q8_x16_matmul",
           "q8_x16_pack", "q8_x16_row_bounds", "q8_x16_rows"]

_SOURCES = [Path(__file__).with_name(n)
            for n in ("q4_1.c", "q4_rows.c", "q8_rows.c", "ops.c", "attention.c",
                      "decode_step.c", "eagle_head.c", "kquants.c", "moe.c")]
_HEADERS = tuple(Path(__file__).with_name(h) for h in ("ops.h", "simd.h", "kquants.h"))
_ENV_VAR = "SGLANG_LIKE_CPU_KERNELS"
_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512vnni", "-DQ4_VNNI"],
}
_COMMON = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-std=c11"]
_CHOICES = ("auto", "off", *_FLAGS)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_isas() -> list[str]:
    """The variants this CPU can run, best first."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return []
    flags = _cpu_flags()
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        out.append("avx512_vnni")
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    return out


def _requested() -> str:
    value = os.environ.get(_ENV_VAR, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{_ENV_VAR}={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


def cache_dir() -> Path:
    root = os.environ.get("SGLANG_LIKE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_like")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _build(variant: str, sources: list[Path] | None = None,
           flags: list[str] | None = None, headers: tuple[Path, ...] = ()) -> Path:
    """A shared library (by default the variant's, of `_SOURCES`; `headers` count in
    its cache key), compiled unless the cache has it (atomic: concurrent builders each write
    a temporary file and rename it into place)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    sources = _SOURCES if sources is None else sources
    flags = _COMMON + (_FLAGS[variant] if flags is None else flags)
    texts = [src.read_text() for src in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, *flags, *version]).encode())
    out = cache_dir() / f"cpu_kernels_{variant}_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the CPU kernels ({variant}):\n"
                               f"{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class _Library:
    def __init__(self, variant: str, path: Path) -> None:
        self.variant = variant
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.q4_1_matmul.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
        lib.q4_1_matmul.restype = ctypes.c_int
        lib.q4_x16_matmul.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64]
        lib.q4_x16_matmul.restype = ctypes.c_int
        lib.q8_x16_matmul.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64]
        lib.q8_x16_matmul.restype = ctypes.c_int
        lib.q8_x16_argmax.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
        lib.q8_x16_argmax.restype = ctypes.c_int
        lib.q4_x16_pack.argtypes = [ptr, i64, i64, ptr]
        lib.q4_x16_pack.restype = None
        lib.q4_x16_dequantize.argtypes = [ptr, i64, i64, ptr]
        lib.q4_x16_dequantize.restype = None
        lib.q4_1_dequantize.argtypes = [ptr, i64, i64, ptr]
        lib.q4_1_dequantize.restype = None
        lib.q4_1_isa.restype = ctypes.c_char_p
        lib.q8_0_matmul_f32.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64]
        lib.q8_0_matmul_f32.restype = ctypes.c_int
        i32, f32 = ctypes.c_int, ctypes.c_float
        lib.add_rmsnorm.argtypes = [ptr, ptr, i32, ptr, ptr, i64, i64, f32, ptr, i32]
        lib.add_rmsnorm.restype = None
        lib.residual_norm.argtypes = [ptr, ptr, i32, ptr, f32, f32, ptr, ptr, i64, i64, f32,
                                      ptr, i32]
        lib.residual_norm.restype = None
        lib.silu_mul.argtypes = [ptr, i32, i64, i64, ptr, i32]
        lib.silu_mul.restype = None
        lib.act_mul.argtypes = [ptr, i32, i64, i64, i32, ptr, i32]
        lib.act_mul.restype = None
        lib.decode_attention_rope.argtypes = [ptr, i32, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                              ptr, i32, ptr, ptr, i64, ptr, ptr, f32, ptr, i32,
                                              i64, f32, i32, ptr, ptr, f32, ptr, ptr, i64]
        lib.decode_attention_rope.restype = ctypes.c_int
        lib.attn_shared_groups.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr]
        lib.attn_shared_groups.restype = ctypes.c_int
        lib.kv_quantize_rows.argtypes = [ptr, i64, i64, i32, i32, ptr, ptr]
        lib.kv_quantize_rows.restype = ctypes.c_int
        lib.decode_step_x16.argtypes = [i64, i64, i64, i64, i64, i64, i64, ptr, ptr, f32, i32,
                                        ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                                        ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr,
                                        i64]
        lib.decode_step_x16.restype = ctypes.c_int
        lib.eagle_head_x16.argtypes = [i64, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr,
                                       i32, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr, ptr, i32,
                                       ptr, i64, ptr, ptr, f32, ptr, ptr, i64, ptr, i64, ptr,
                                       ptr]
        lib.eagle_head_x16.restype = ctypes.c_int
        lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
        lib.argmax_rows.restype = None
        lib.kq_matmul.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64]
        lib.kq_matmul.restype = ctypes.c_int
        lib.kq_dequantize.argtypes = [i32, ptr, i64, i64, ptr]
        lib.kq_dequantize.restype = ctypes.c_int
        lib.kq_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr]
        lib.kq_rows.restype = ctypes.c_int
        lib.moe_forward.argtypes = [i64, i64, ptr, ptr, i32, ptr, ptr, ptr]
        lib.moe_forward.restype = ctypes.c_int
        lib.kq_record_bytes.argtypes = [i32]
        lib.kq_record_bytes.restype = ctypes.c_int
        lib.kq_any_matmul.argtypes = lib.kq_matmul.argtypes
        lib.kq_any_matmul.restype = ctypes.c_int
        lib.kq_set_tiles.argtypes = [ptr, i64]
        lib.kq_set_tiles.restype = None
        lib.attn_set_tiles.argtypes = [ptr]
        lib.attn_set_tiles.restype = None
        lib.q8x_set_tiles.argtypes = [ptr, i64]
        lib.q8x_set_tiles.restype = None
        built = lib.q4_1_isa().decode()
        if built != variant:
            raise RuntimeError(f"{path} is the {built} build, not {variant}")
        self.matmul = lib.q4_1_matmul
        self.x16_matmul = lib.q4_x16_matmul
        self.x16_pack = lib.q4_x16_pack
        self.q8_x16_matmul = lib.q8_x16_matmul
        self.q8_x16_argmax = lib.q8_x16_argmax
        self.x16_dequantize = lib.q4_x16_dequantize
        self.dequantize = lib.q4_1_dequantize
        self.q8_0_matmul_f32 = lib.q8_0_matmul_f32
        self.add_rmsnorm = lib.add_rmsnorm
        self.silu_mul = lib.silu_mul
        self.act_mul = lib.act_mul
        self.residual_norm = lib.residual_norm
        self.decode_attention_rope = lib.decode_attention_rope
        self.attn_shared_groups = lib.attn_shared_groups
        self.kv_quantize_rows = lib.kv_quantize_rows
        self.decode_step_x16 = lib.decode_step_x16
        self.eagle_head_x16 = lib.eagle_head_x16
        self.argmax_rows = lib.argmax_rows
        self.kq_matmul = lib.kq_matmul
        self.kq_dequantize = lib.kq_dequantize
        self.kq_rows = lib.kq_rows
        self.kq_record_bytes = lib.kq_record_bytes
        self.moe_forward = lib.moe_forward
        self.set_tiles = lib.kq_set_tiles
        self.attn_set_tiles = lib.attn_set_tiles
        self.q8x_set_tiles = lib.q8x_set_tiles
        self.kq_any_matmul = lib.kq_any_matmul


# From this many activation rows (Q6_K: twice) the fused decode step and the MoE layers run
# their x16 and GGUF-kind linears on AMX tiles (amx_kq.c, the same bits as the VNNI kernel);
# below it the tiles' fixed cost per block loses to VNNI (docs/cpu-kernels.md)
KQ_TILE_MIN_ROWS = 32
# From this many greedy rows q8_x16_argmax's first pass (every logit's first part, to bound
# which groups can hold the maximum) runs on the tiles, with the same bounds: 1.2-1.5x the
# vector pass from 8 rows, equal below (docs/cpu-kernels.md)
Q8X_ARGMAX_TILE_MIN_ROWS = 8


@functools.cache
def _library(variant: str) -> _Library | None:
    try:
        lib = _Library(variant, _build(variant, headers=_HEADERS))
    except (RuntimeError, OSError) as exc:
        logger.warning("native CPU kernels (%s) unavailable, using torch's: %s", variant, exc)
        return None
    if variant == "avx512_vnni" and _tiles_lent:  # the tiles give the VNNI build's bits only
        _lend(lib)
    return lib


# amx.py's kernels lent to the VNNI build: amx_kq.c's group kernel, amx_attn.c's cascade,
# amx_q8x16.c's first pass of the greedy head; and which of the last two are lent
# (use_tiles)
_tiles_lent: list[int] = []
_tiles_on = {"cascade": True, "argmax": True}


def _lend(lib: _Library) -> None:
    group, shared, head = _tiles_lent
    lib.set_tiles(group, KQ_TILE_MIN_ROWS)
    lib.attn_set_tiles(shared if _tiles_on["cascade"] else None)
    lib.q8x_set_tiles(head if _tiles_on["argmax"] else None, Q8X_ARGMAX_TILE_MIN_ROWS)


def lend_tiles(group_address: int, shared_address: int, head_address: int) -> None:
    """amx.py, once its library loads, lends amx_kq.c's group kernel, amx_attn.c's cascade
    and amx_q8x16.c's greedy head pass to the VNNI build (now or when it loads): quantized
    layers and the native decode plan load the AMX library before any decode step runs."""
    _tiles_lent[:] = [group_address, shared_address, head_address]
    if _default_isa() == "avx512_vnni":  # else _library gives them if it is ever loaded
        _lend(_library("avx512_vnni"))


def use_tiles(kernel: str, enabled: bool) -> bool:
    """Whether the VNNI build runs `kernel` on the AMX tiles the AMX library lends it (where
    it is loaded; default on), or on the vector unit. "cascade": the decode attention over a
    shared prefix (bf16 pool), whose vector bits the AVX2 build shares and the tiles' differ
    from; "argmax": the greedy head's first pass (q8_x16_argmax), the same result either way.
    Returns the previous setting."""
    if kernel not in _tiles_on:
        raise ValueError(f"kernel={kernel!r}: expected one of {sorted(_tiles_on)}")
    previous, _tiles_on[kernel] = _tiles_on[kernel], enabled
    if _tiles_lent:  # lent only where the VNNI build runs
        _lend(_library("avx512_vnni"))
    return previous


def isa(variant: str | None = None) -> str | None:
    """The variant calls run on (None: torch's kernels); `variant` asks for one explicitly
    (tests run both on a CPU that has both)."""
    if variant is None:
        return _default_isa()
    return variant if _library(variant) is not None else None


@functools.lru_cache(maxsize=1)
def _default_isa() -> str | None:
    """This CPU's best variant, or the one `SGLANG_LIKE_CPU_KERNELS` names (once per process)."""
    requested = _requested()
    if requested == "off":
        return None
    supported = supported_isas()
    if requested != "auto":
        if requested not in supported:
            raise ValueError(f"{_ENV_VAR}={requested}: this CPU runs only {supported}")
        variant = requested
    elif supported:
        variant = supported[0]
    else:
        return None
    return variant if _library(variant) is not None else None


def available() -> bool:
    return isa() is not None


def _lib(variant: str | None) -> _Library:
    """The library of `variant` (None: this CPU's best); the hot path is two cache hits."""
    v = _default_isa() if variant is None else variant
    lib = _library(v) if v is not None else None
    if lib is None:
        raise RuntimeError("native CPU kernels are unavailable on this machine")
    return lib


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: float32 with contiguous rows (a row stride is allowed)."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(rc: int, name: str, x: torch.Tensor) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} failed for x {tuple(x.shape)} (K must be a multiple of 32)")


def q4_1_matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int,
                variant: str | None = None, invariant: bool = False) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) @ W.T -> [M, N] float32; W [N, K] as Q4_1 blocks
    `blocks` uint8 [N, K/32*20]. `invariant`: a lone row summed as in a batch (same bits;
    slower at one row)."""
    x = _float_rows(x)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        _check(_lib(variant).matmul(blocks.data_ptr(), out_features, k, x.data_ptr(),
                                    x.stride(0), m, y.data_ptr(), out_features,
                                    int(invariant)),
               "q4_1_matmul", x)
    return y


X16_ROWS = 16  # output rows per group of the x16 layout
X16_RECORD_BYTES = 320  # per group and block of 32 columns


def q4_x16_pack(blocks: torch.Tensor, out_features: int, in_features: int,
                variant: str | None = None) -> torch.Tensor:
    """Q4_1 blocks uint8 [N, K/32*20] -> the x16 layout uint8 [N/16, K/32*320] (q4_rows.c:
    16 output rows interleaved per block, so one vector holds every row's codes)."""
    if out_features % X16_ROWS or in_features % 32:
        raise ValueError(f"x16 needs N % {X16_ROWS} == 0 and K % 32 == 0; got "
                         f"{out_features}x{in_features}")
    blocks = blocks.contiguous()
    out = torch.empty(out_features // X16_ROWS, in_features // 32 * X16_RECORD_BYTES,
                      dtype=torch.uint8)
    _lib(variant).x16_pack(blocks.data_ptr(), out_features, in_features, out.data_ptr())
    return out


def q4_x16_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  variant: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W in the x16 layout (`q4_x16_pack`);
    activations quantized to int8 per block of 32. A row's result does not depend on M."""
    x = _float_rows(x)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        _check(_lib(variant).x16_matmul(packed.data_ptr(), out_features, k, x.data_ptr(),
                                        x.stride(0), m, y.data_ptr(), out_features),
               "q4_x16_matmul", x)
    return y


def q4_x16_dequantize(packed: torch.Tensor, out_features: int, in_features: int,
                      variant: str | None = None) -> torch.Tensor:
    """The float32 [N, K] matrix an x16-packed tensor holds."""
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    _lib(variant).x16_dequantize(packed.data_ptr(), out_features, in_features, out.data_ptr())
    return out


# kquants.c's kinds: code bits and scaling of the GGUF types it runs (see there)
KQ_KINDS = {"q4m": 0, "iq4": 1, "q5o": 2, "q5m": 3, "q6": 4, "q8": 5}


def kq_record_bytes(kind: str) -> int:
    """Bytes per record (16 rows x 32 columns) of a kquants.c kind."""
    return int(_lib(None).kq_record_bytes(KQ_KINDS[kind]))


def kq_matmul(x: torch.Tensor, packed: torch.Tensor, kind: str, out_features: int,
              variant: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W packed as `kind` (kquants.c);
    activations quantized to int8 per block of 32. A row's result does not depend on M."""
    x = _float_rows(x)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        _check(_lib(variant).kq_matmul(KQ_KINDS[kind], packed.data_ptr(), out_features, k,
                                       x.data_ptr(), x.stride(0), m, y.data_ptr(),
                                       out_features),
               "kq_matmul", x)
    return y


def kq_native_step_matmul(x: torch.Tensor, packed: torch.Tensor, kind: str | None,
                          out_features: int, variant: str | None = None) -> torch.Tensor:
    """x @ W.T as the fused decode step and the MoE layers multiply (kind None: the x16 Q4_1
    layout): on AMX tiles from KQ_TILE_MIN_ROWS rows where the VNNI build has them, else
    the vector kernel; the same bits either way."""
    x = _float_rows(x)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        code = -1 if kind is None else KQ_KINDS[kind]
        _check(_lib(variant).kq_any_matmul(code, packed.data_ptr(), out_features, k,
                                           x.data_ptr(), x.stride(0), m, y.data_ptr(),
                                           out_features),
               "kq_native_step_matmul", x)
    return y


def kq_dequantize(packed: torch.Tensor, kind: str, out_features: int, in_features: int,
                  variant: str | None = None) -> torch.Tensor:
    """The float32 [N, K] matrix a kquants.c-packed tensor holds."""
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    rc = _lib(variant).kq_dequantize(KQ_KINDS[kind], packed.data_ptr(), out_features,
                                     in_features, out.data_ptr())
    if rc != 0:
        raise ValueError(f"kq_dequantize: bad kind or shape {out_features}x{in_features}")
    return out


def kq_rows(packed: torch.Tensor, kind: str, out_features: int, in_features: int,
            ids: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of a kquants.c-packed [N, K] matrix as float32 [T, K]: the same
    values `kq_dequantize` gives them (an embedding kept in the file's codes)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    rc = _lib(variant).kq_rows(KQ_KINDS[kind], packed.data_ptr(), out_features, in_features,
                               ids.data_ptr(), ids.shape[0], out.data_ptr())
    if rc == -2:
        raise IndexError(f"kq_rows: a token id outside [0, {out_features})")
    if rc != 0:
        raise ValueError(f"kq_rows: bad kind or shape {out_features}x{in_features}")
    return out


def q8_x16_pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-int8 rows (codes int8 [N, K], scales float32 [N, K/32]) -> the q8 x16 layout
    (q8_rows.c): codes [N/16, K/32, 8, 16, 4], scales [N/16, K/32, 16]."""
    n, k = codes.shape
    if n % X16_ROWS or k % 32:
        raise ValueError(f"x16 needs N % {X16_ROWS} == 0 and K % 32 == 0; got {n}x{k}")
    g, nb = n // X16_ROWS, k // 32
    packed = codes.view(g, X16_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    return packed, scales.view(g, X16_ROWS, nb).permute(0, 2, 1).contiguous()


def q8_x16_rows(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `ids` of a q8 x16 matrix as (codes int8 [T, K], scales [T, K/32])."""
    g, r = ids // X16_ROWS, ids % X16_ROWS
    # views with (group, row) leading: one gather of T rows (K bytes each) per tensor
    codes = packed.permute(0, 3, 1, 2, 4)[g, r]  # [T, K/32, 8, 4]
    return codes.reshape(ids.shape[0], -1), scales.permute(0, 2, 1)[g, r]


def q8_x16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  variant: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W in the q8 x16 layout (`q8_x16_pack`);
    activations quantized to int8 per block of 32. A row's result does not depend on M."""
    x = _float_rows(x)
    m, k = x.shape
    n = packed.shape[0] * X16_ROWS
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _check(_lib(variant).q8_x16_matmul(packed.data_ptr(), scales.data_ptr(), n, k,
                                           x.data_ptr(), x.stride(0), m, y.data_ptr(), n),
               "q8_x16_matmul", x)
    return y


def q8_x16_row_bounds(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N]: each row's largest |scale| * sum |code| over its blocks, rounded up
    (what `q8_x16_argmax` bounds a logit's second activation part with)."""
    l1 = packed.to(torch.int32).abs().sum(dim=(2, 4))  # [N/16, K/32, 16]; |-128| fits
    bound = (l1.double() * scales.double().abs()).amax(dim=1).reshape(-1)
    up = bound.float()
    return torch.where(up.double() < bound, torch.nextafter(up, torch.tensor(float("inf"))), up)


def q8_x16_argmax(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  row_bounds: torch.Tensor, variant: str | None = None
                  ) -> tuple[torch.Tensor, int]:
    """(the argmax of each row of `q8_x16_matmul(x, packed, scales)` int64 [M], how many
    16-row groups were computed in full): the same index as `argmax_rows` of those logits
    (first among equals, NaN as the maximum), with the second activation part computed only
    for the rows that can win (`row_bounds`: `q8_x16_row_bounds`). AVX-512 VNNI builds only
    (NotImplementedError elsewhere)."""
    x = _float_rows(x)
    m, k = x.shape
    n = packed.shape[0] * X16_ROWS
    ids = torch.empty(m, dtype=torch.int64)
    exact = ctypes.c_int64(0)
    if m:
        rc = _lib(variant).q8_x16_argmax(packed.data_ptr(), scales.data_ptr(),
                                         row_bounds.data_ptr(), n, k, x.data_ptr(), x.stride(0),
                                         m, ids.data_ptr(), ctypes.byref(exact))
        if rc == -2:
            raise NotImplementedError("q8_x16_argmax needs the avx512_vnni build")
        _check(rc, "q8_x16_argmax", x)
    return ids, exact.value


def q8_0_matmul_f32(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    variant: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32 with W = codes int8 [N, K] times scales
    float32 [N, K/32] (one per 32 columns), activations kept float32."""
    x = _float_rows(x)
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _check(_lib(variant).q8_0_matmul_f32(codes.data_ptr(), scales.data_ptr(), n, k,
                                             x.data_ptr(), x.stride(0), m, y.data_ptr(), n),
               "q8_0_matmul_f32", x)
    return y


def q4_1_dequantize(blocks: torch.Tensor, out_features: int, in_features: int,
                    variant: str | None = None) -> torch.Tensor:
    """The float32 [N, K] matrix the blocks hold."""
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    _lib(variant).dequantize(blocks.data_ptr(), out_features, in_features, out.data_ptr())
    return out
