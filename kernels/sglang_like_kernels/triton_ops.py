"""Triton launchers: shapes, block sizes and grids for the kernels in triton_kernels.

The launchers take the same arguments as reference.py. They run on CUDA tensors, and
on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
Each ``*_meta`` helper returns the compile-time constants its launcher uses, so the
ahead-of-time compile test builds exactly what runs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_like_kernels import kv_quant
from sglang_like_kernels import triton_kernels as tk
from sglang_like_kernels.reference import check_window_softcap

__all__ = [
    "MoeAlignment",
    "apply_token_bitmask_",
    "fused_moe",
    "fused_moe_meta",
    "moe_align",
    "lora_delta_",
    "lora_meta",
    "decode_attention",
    "masked_attention",
    "masked_meta",
    "decode_meta",
    "extend_attention",
    "extend_meta",
    "store_kv",
    "tree_verify_attention",
    "tree_verify_meta",
]

# A quantized pool's rows are code * scale in float32; on GPU they go to tl.dot in bf16 (8
# bits of mantissa hold an int8 code's 7 and the rounding of its scale's product).
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.int8: tl.bfloat16,
               torch.float8_e4m3fn: tl.bfloat16, torch.float8_e5m2: tl.bfloat16}
# triton_kernels' KV_KIND of each pool dtype (0: a float pool)
_KV_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
# Warps of the attention kernels on a GPU. With 4, ptxas spilled registers to local memory
# in most of them (a 64 x 64 bf16 tile at head dim 128: 1.4 KB a thread on sm_90); with 8
# and the tiles below none do on sm_90 or sm_80, which tests/kernels/cases_aot.py checks on
# ptxas's own figures for every launch signature.
_ATTENTION_WARPS = 8
# Split attention (flash-decoding; a verify's or a masked batch's prefix): at most
# _MAX_SPLITS programs a request (or row block), each at least _SPLIT_TOKENS keys.
_MAX_SPLITS = 16
_SPLIT_TOKENS = 256
# A verify's or masked batch's splits stop once its grid has about this many programs
# (about 8 an SM on an H100's 132): a big batch fills the GPU with its (B, Hq) programs
# alone, and its splits would only add partials to write and merge. A first guess, for
# scripts/gpu_check.py's verify rows to confirm.
_SPLIT_PROGRAMS = 1024
_BITMASK_BLOCK = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _resolve(interpret: bool | None) -> bool:
    return _interpreting() if interpret is None else interpret


def dot_dtype(pool_dtype: torch.dtype, interpret: bool | None = None) -> tl.dtype:
    """The tl.dot operand dtype: the pool's 16-bit type on GPU, fp32 otherwise."""
    if _resolve(interpret):
        return tl.float32
    return _DOT_DTYPES.get(pool_dtype, tl.float32)


def _tile(dot: tl.dtype, interpret: bool | None) -> int:
    """Key/query tile length. Exact fp32 dots run on CUDA cores, where 32-wide tiles keep
    registers (and compile time) sane; the interpreter is fastest with big tiles."""
    return 32 if dot == tl.float32 and not _resolve(interpret) else 64


def _decode_warps(dot: tl.dtype) -> int:
    """fp32 dots on CUDA cores hold fewer tile registers a thread with 4 warps' worth of
    work each (8 spilled 8 bytes on sm_90); 16-bit tiles spill with 4."""
    return 4 if dot == tl.float32 else _ATTENTION_WARPS


def _verify_heads(group: int, dot: tl.dtype, interpret: bool | None = None) -> int:
    """Query heads a tree-verify program takes: a kv head's whole group, whose keys it then
    reads once; one for exact fp32 dots, which run on CUDA cores and spilled registers with
    the group's rows (tests/kernels/cases_aot.py)."""
    return 1 if dot == tl.float32 and not _resolve(interpret) else group


def _verify_rows(num_draft: int, heads: int, interpret: bool | None = None) -> int:
    """A tree-verify program's query rows (BLOCK_R): the drafts x its heads, at most 32 on a
    GPU (register room), 64 in the interpreter."""
    return min(_block(num_draft * heads), 64 if _resolve(interpret) else 32)


def _block(n: int) -> int:
    """tl.dot needs every block dimension to be a power of two of at least 16."""
    return max(16, triton.next_power_of_2(n))


def _flags(window: int | None, softcap: float | None,
           pool_dtype: torch.dtype) -> dict[str, object]:
    """The attention kernels' switches: with all off they compile as they did without."""
    return {"USE_WINDOW": window is not None, "USE_SOFTCAP": softcap is not None,
            "KV_KIND": _KV_KINDS.get(pool_dtype, 0)}


def _kv_args(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(k_pool, v_pool, k_scale, v_scale, scale row stride) as the kernels take them: fp8
    codes as their bytes, and the pools themselves in the scales' place for a float pool
    (never read there: KV_KIND 0)."""
    if not kv_quant.is_quantized(k_pool.dtype):
        return k_pool, v_pool, k_pool, v_pool, 0
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_pool.dtype} KV pool needs its scales (k_scale / v_scale)")
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(1) == 1
    return (kv_quant.as_bytes(k_pool), kv_quant.as_bytes(v_pool), k_scale, v_scale,
            k_scale.stride(0))


def _query_for(q: torch.Tensor, k_pool: torch.Tensor) -> torch.Tensor:
    """q as the kernels take it: contiguous in its last dim, and rotated over a quantized pool
    (kv_quant.query_for)."""
    return kv_quant.query_for(_inner_contiguous(q), k_pool.dtype)


def _output_for(out: torch.Tensor, k_pool: torch.Tensor) -> torch.Tensor:
    return kv_quant.output_for(out, k_pool.dtype)


def _runtime(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The runtime values behind the switches (unused when a switch is off)."""
    check_window_softcap(window, softcap)
    return (0 if window is None else int(window)), (0.0 if softcap is None else float(softcap))


def decode_meta(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    pool_dtype: torch.dtype,
    num_splits: int | None = None,
    interpret: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    split_min: int = _SPLIT_TOKENS,
) -> dict[str, object]:
    """Constexprs of decode_split_kernel (split_reduce_kernel takes NUM_SPLITS, BLOCK_S,
    BLOCK_D from the same dict). NUM_SPLITS, the programs a request gets, follows the
    longest context the table holds (a window caps it), so one compiled kernel serves
    every batch; each request then splits its own keys in pieces of at least `split_min`."""
    dtype = dot_dtype(pool_dtype, interpret)
    if num_splits is None:
        keys = max_context if window is None else min(max_context, window)
        num_splits = min(_MAX_SPLITS, max(1, triton.cdiv(keys, split_min)))
    return {
        "NUM_SPLITS": num_splits,
        "BLOCK_G": _block(num_q_heads // num_kv_heads),
        "BLOCK_N": _tile(dtype, interpret),
        "BLOCK_D": _block(head_dim),
        "DOT_DTYPE": dtype,
        "BLOCK_S": triton.next_power_of_2(num_splits),
        "SPLIT_MIN": split_min,
        "num_warps": _decode_warps(dtype),
        **_flags(window, softcap, pool_dtype),
    }


def extend_meta(
    head_dim: int, pool_dtype: torch.dtype, interpret: bool | None = None,
    window: int | None = None, softcap: float | None = None,
) -> dict[str, object]:
    """Constexprs of extend_kernel: 32 x 32 tiles on a GPU (64-row bf16 ones spilled over
    a quantized pool, whose codes are widened and scaled in registers, or with a window)."""
    dtype = dot_dtype(pool_dtype, interpret)
    block = 64 if _resolve(interpret) else 32
    return {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": _block(head_dim), "DOT_DTYPE": dtype,
            "num_warps": _ATTENTION_WARPS, **_flags(window, softcap, pool_dtype)}


def _prefix_splits(max_context: int, window: int | None, split_min: int,
                   num_programs: int) -> int:
    """NUM_SPLITS of a launch that splits its requests' prefixes: decode's rule (the longest
    prefix the table holds, or the window, in pieces of split_min, at most _MAX_SPLITS), no
    more than bring the grid's num_programs to _SPLIT_PROGRAMS, rounded down to a power of
    two so that batch sizes share a handful of compiled kernels. All host ints: choosing
    reads nothing back from the device."""
    keys = max_context if window is None else min(max_context, window)
    splits = min(_MAX_SPLITS, triton.cdiv(keys, split_min), _SPLIT_PROGRAMS // num_programs)
    return 1 << (max(splits, 1).bit_length() - 1)


def _split_meta(max_context: int, window: int | None, split_min: int, num_programs: int,
                num_splits: int | None) -> dict[str, int]:
    """The split constexprs (BLOCK_S for split_reduce_kernel)."""
    if num_splits is None:
        num_splits = _prefix_splits(max_context, window, split_min, num_programs)
    return {"NUM_SPLITS": num_splits, "SPLIT_MIN": split_min,
            "BLOCK_S": triton.next_power_of_2(num_splits)}


def tree_verify_meta(
    num_draft: int, head_dim: int, pool_dtype: torch.dtype, interpret: bool | None = None,
    window: int | None = None, softcap: float | None = None, max_context: int = 0,
    num_programs: int = 1, num_splits: int | None = None, split_min: int = _SPLIT_TOKENS,
    group: int = 1,
) -> dict[str, object]:
    """Constexprs of tree_verify_kernel (split_reduce_kernel takes NUM_SPLITS, BLOCK_S,
    BLOCK_D). A program's BLOCK_R rows are draft queries x HEADS query heads of a kv head
    (`_verify_heads`), at most 32 of them on a GPU (register room: a verify of 12 drafts at
    group 4 is two blocks). NUM_SPLITS (default _prefix_splits) follows the table's width
    `max_context` and the launch's programs `num_programs` (B * Hq / HEADS * row blocks);
    each request then splits its own prefix in pieces of at least `split_min` keys, so a
    short one uses one split."""
    dtype = dot_dtype(pool_dtype, interpret)
    heads = _verify_heads(group, dtype, interpret)
    return {
        "HEADS": heads,
        "BLOCK_R": _verify_rows(num_draft, heads, interpret),
        "BLOCK_M": _block(num_draft),
        # 32 keys on a GPU, as extend's tiles (64 beside 32 rows spilled)
        "BLOCK_N": 64 if _resolve(interpret) else 32,
        "BLOCK_D": _block(head_dim),
        "DOT_DTYPE": dtype,
        "num_warps": _ATTENTION_WARPS,
        **_flags(window, softcap, pool_dtype),
        **_split_meta(max_context, window, split_min, num_programs, num_splits),
    }


def masked_meta(
    head_dim: int, pool_dtype: torch.dtype, interpret: bool | None = None,
    window: int | None = None, softcap: float | None = None, max_context: int = 0,
    num_programs: int = 1, num_splits: int | None = None, split_min: int = _SPLIT_TOKENS,
) -> dict[str, object]:
    """Constexprs of masked_kernel: the extend kernel's tiles, and tree_verify_meta's splits
    (`num_programs`: B * Hq * row blocks)."""
    return {**extend_meta(head_dim, pool_dtype, interpret, window=window, softcap=softcap),
            **_split_meta(max_context, window, split_min, num_programs, num_splits)}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and scratch buffer comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _split_buffers(rows: int, num_q_heads: int, head_dim: int, meta: dict[str, object],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mid_out [rows, Hq, NUM_SPLITS, D], mid_lse [rows, Hq, NUM_SPLITS]) fp32 for the splits'
    partials; with one split a placeholder each (the kernel writes the output itself)."""
    splits = meta["NUM_SPLITS"]
    if splits == 1:
        return _empty((1,), torch.float32, device), _empty((1,), torch.float32, device)
    return (_empty((rows, num_q_heads, splits, head_dim), torch.float32, device),
            _empty((rows, num_q_heads, splits), torch.float32, device))


def _reduce_splits(mid_out: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
                   meta: dict[str, object]) -> None:
    """out [rows, Hq, D] = each row's splits merged (split_reduce_kernel)."""
    rows, num_q_heads, head_dim = out.shape
    tk.split_reduce_kernel[(rows, num_q_heads)](
        mid_out, mid_lse, out,
        out.stride(0), out.stride(1),
        num_q_heads, head_dim,
        NUM_SPLITS=meta["NUM_SPLITS"], BLOCK_S=meta["BLOCK_S"], BLOCK_D=meta["BLOCK_D"],
    )  # fmt: skip


def _kernel_meta(meta: dict[str, object]) -> dict[str, object]:
    """A split meta without the reduce's own BLOCK_S."""
    return {k: v for k, v in meta.items() if k != "BLOCK_S"}


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index the last dim with unit stride; other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """pool[slot_ids] = k, v.

    k_pool, v_pool: [num_slots, Hkv, D] (contiguous); slot_ids: [T] int; k, v: [T, Hkv, D]
    in any float dtype (cast to the pool dtype first), any strides. A quantized pool gets
    kv_quant.quantize's codes, and the rows' scales go to k_scale / v_scale [num_slots, Hkv].
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    assert k_pool.stride() == v_pool.stride()
    slot_ids = slot_ids.to(device=k_pool.device)
    if kv_quant.is_quantized(k_pool.dtype):
        # codes and scales made in torch (the reference's bits), the codes then copied as
        # bytes by the kernel below
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_pool.dtype} KV pool needs its scales (k_scale / v_scale)")
        (k, ks), (v, vs) = kv_quant.quantize(k, k_pool.dtype), kv_quant.quantize(v, v_pool.dtype)
        k_scale.index_copy_(0, slot_ids.long(), ks)
        v_scale.index_copy_(0, slot_ids.long(), vs)
        k_pool, v_pool = kv_quant.as_bytes(k_pool), kv_quant.as_bytes(v_pool)
        k, v = kv_quant.as_bytes(k), kv_quant.as_bytes(v)
    # Cast in torch (round to nearest) so the kernel is a plain copy: the interpreter's
    # fp32 -> bf16 conversion truncates instead.
    k = _inner_contiguous(k.to(k_pool.dtype))
    v = _inner_contiguous(v.to(v_pool.dtype))
    tk.store_kv_kernel[(num_tokens,)](
        k_pool, v_pool, slot_ids, k, v,
        k_pool.stride(0), k_pool.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_min: int = _SPLIT_TOKENS,
) -> torch.Tensor:
    """Flash-decoding: one query per request over its cached tokens.

    q: [B, Hq, D]; k_pool, v_pool: [num_slots, Hkv, D] contiguous, Hq % Hkv == 0;
    req_to_token: [max_requests, max_context] int32; req_pool_indices, seq_lens: [B] int
    (seq_lens >= 1). Returns [B, Hq, D] in q's dtype. The visible keys of each request (its
    last `window`, or all) are cut into at most num_splits pieces (default from max_context
    and the window) of at least `split_min` keys, scored in parallel, then merged.
    `softcap`: scores -> cap * tanh(scores / cap).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.stride() == v_pool.stride()
    out = _empty(q.shape, q.dtype, q.device)
    if batch == 0:
        return out
    q = _query_for(q, k_pool)
    window_value, softcap_value = _runtime(window, softcap)
    meta = decode_meta(
        num_q_heads, num_kv_heads, head_dim, req_to_token.shape[1], k_pool.dtype, num_splits,
        window=window, softcap=softcap, split_min=split_min,
    )
    splits = meta["NUM_SPLITS"]
    device = q.device
    mid_out = _empty((batch, num_q_heads, splits, head_dim), torch.float32, device)
    mid_lse = _empty((batch, num_q_heads, splits), torch.float32, device)
    k_arg, v_arg, ks_arg, vs_arg, stride_scale = _kv_args(k_pool, v_pool, k_scale, v_scale)
    tk.decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_arg, v_arg, ks_arg, vs_arg, req_to_token, req_pool_indices.to(device),
        seq_lens.to(device), mid_out, mid_lse,
        sm_scale, window_value, softcap_value,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), stride_scale,
        req_to_token.stride(0),
        num_q_heads, num_q_heads // num_kv_heads, head_dim,
        NUM_SPLITS=splits, BLOCK_G=meta["BLOCK_G"], BLOCK_N=meta["BLOCK_N"],
        BLOCK_D=meta["BLOCK_D"], DOT_DTYPE=meta["DOT_DTYPE"], USE_WINDOW=meta["USE_WINDOW"],
        USE_SOFTCAP=meta["USE_SOFTCAP"], KV_KIND=meta["KV_KIND"], SPLIT_MIN=meta["SPLIT_MIN"],
        num_warps=meta["num_warps"],
    )  # fmt: skip
    _reduce_splits(mid_out, mid_lse, out, meta)
    return _output_for(out, k_pool)


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over prefix + themselves (the token at
    position p over p - window < j <= p with a `window`; scores soft-capped with `softcap`).

    q: [T, Hq, D], request b's extend_lens[b] rows contiguous in batch order; their K/V
    are at req_to_token[req_pool_indices[b], prefix_lens[b] : prefix_lens[b] +
    extend_lens[b]]; k_pool, v_pool: [num_slots, Hkv, D]; prefix_lens, extend_lens: [B]
    int (CPU or device; the max extend length is read on the host unless `max_extend_len`
    gives it). Returns [T, Hq, D] in q's dtype.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.stride() == v_pool.stride()
    out = _empty(q.shape, q.dtype, q.device)
    batch = extend_lens.shape[0]
    if max_extend_len is not None:
        max_extend = max_extend_len
    else:
        max_extend = int(extend_lens.max()) if batch else 0
    if max_extend == 0:
        return out
    q = _query_for(q, k_pool)
    device = q.device
    extend_lens = extend_lens.to(device=device, dtype=torch.int64)
    extend_starts = torch.cumsum(extend_lens, 0) - extend_lens
    window_value, softcap_value = _runtime(window, softcap)
    meta = extend_meta(head_dim, k_pool.dtype, window=window, softcap=softcap)
    grid = (batch, num_q_heads, triton.cdiv(max_extend, meta["BLOCK_M"]))
    k_arg, v_arg, ks_arg, vs_arg, stride_scale = _kv_args(k_pool, v_pool, k_scale, v_scale)
    tk.extend_kernel[grid](
        q, k_arg, v_arg, ks_arg, vs_arg, out, req_to_token, req_pool_indices.to(device),
        prefix_lens.to(device), extend_lens, extend_starts,
        sm_scale, window_value, softcap_value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), stride_scale, req_to_token.stride(0),
        num_q_heads // num_kv_heads, head_dim,
        **meta,
    )  # fmt: skip
    return _output_for(out, k_pool)


def tree_verify_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_min: int = _SPLIT_TOKENS,
) -> torch.Tensor:
    """Speculative verify: N draft tokens per request over the prefix and their tree.

    q: [B*N, Hq, D]; draft K/V at positions prefix_lens[b]..prefix_lens[b]+N-1 of row
    req_pool_indices[b]; tree_mask: bool [B, N, N] (draft query i sees draft key j iff
    tree_mask[b, i, j]); prefix_lens: [B] int. With a `window` each query keeps the last
    `window` of its visible keys in position order; `softcap` caps the scores. Returns
    [B*N, Hq, D] in q's dtype. Each request's prefix is cut into at most num_splits pieces
    (default tree_verify_meta's, from req_to_token's width and B * Hq) of at least
    `split_min` keys, attended in parallel, then merged, as decode_attention does.
    """
    batch, num_draft, _ = tree_mask.shape
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    assert q.shape[0] == batch * num_draft and num_q_heads % num_kv_heads == 0
    out = _empty(q.shape, q.dtype, q.device)
    if batch == 0 or num_draft == 0:
        return out
    q = _query_for(q, k_pool)
    device = q.device
    mask = tree_mask.to(device=device, dtype=torch.int8).contiguous()
    window_value, softcap_value = _runtime(window, softcap)
    group = num_q_heads // num_kv_heads
    heads = _verify_heads(group, dot_dtype(k_pool.dtype))
    row_blocks = triton.cdiv(num_draft * heads, _verify_rows(num_draft, heads))
    meta = tree_verify_meta(
        num_draft, head_dim, k_pool.dtype, window=window, softcap=softcap,
        max_context=req_to_token.shape[1],
        num_programs=batch * (num_q_heads // heads) * row_blocks,
        num_splits=num_splits, split_min=split_min, group=group,
    )  # fmt: skip
    mid_out, mid_lse = _split_buffers(q.shape[0], num_q_heads, head_dim, meta, device)
    k_arg, v_arg, ks_arg, vs_arg, stride_scale = _kv_args(k_pool, v_pool, k_scale, v_scale)
    tk.tree_verify_kernel[(batch, num_q_heads // heads, row_blocks * meta["NUM_SPLITS"])](
        q, k_arg, v_arg, ks_arg, vs_arg, out, mid_out, mid_lse, req_to_token,
        req_pool_indices.to(device), prefix_lens.to(device), mask,
        sm_scale, window_value, softcap_value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), stride_scale, req_to_token.stride(0),
        num_draft, num_q_heads, group, head_dim,
        **_kernel_meta(meta),
    )  # fmt: skip
    if meta["NUM_SPLITS"] > 1:
        _reduce_splits(mid_out, mid_lse, out, meta)
    return _output_for(out, k_pool)


def _mask_offsets(rows: list[int], cols: list[int]) -> torch.Tensor:
    """The masked kernel's per-request offsets: row starts, rows, mask starts, columns
    (int64 [4 * B], host)."""
    batch = len(rows)
    starts, mask_starts = [0] * batch, [0] * batch
    for b in range(1, batch):
        starts[b] = starts[b - 1] + rows[b - 1]
        mask_starts[b] = mask_starts[b - 1] + rows[b - 1] * cols[b - 1]
    return torch.tensor([starts, rows, mask_starts, cols], dtype=torch.int64).flatten()


def masked_offsets(rows: list[int], cols: list[int], device: torch.device) -> torch.Tensor:
    """`masked_attention`'s `mask_meta` for masks of these shapes (no positional rows), on
    `device`."""
    return torch.cat([_mask_offsets(rows, cols), torch.zeros(len(rows), dtype=torch.int64)]
                     ).to(device)


def masked_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    masks: list[torch.Tensor],
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    positional: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_min: int = _SPLIT_TOKENS,
    mask_meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention under a mask of its own per request (reference.masked_attention: ragged
    draft trees, verifies beside extends). The masks' shapes give the grid and every offset
    on the host, so a launch reads nothing back; host masks cross with the offsets in one
    copy. Prefixes are split as tree_verify_attention's (num_splits default: masked_meta's).
    `mask_meta`: the offsets already on the device (`masked_offsets`, for these shapes and
    no `positional`), so that the call copies nothing from the host (a CUDA graph's)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.stride() == v_pool.stride()
    out = _empty(q.shape, q.dtype, q.device)
    batch = len(masks)
    rows = [int(m.shape[0]) for m in masks]
    cols = [int(m.shape[1]) for m in masks]
    assert sum(rows) == q.shape[0] and prefix_lens.shape[0] == batch
    if max(rows, default=0) == 0:
        return out
    q = _query_for(q, k_pool)
    device = q.device
    flat = torch.cat([m.reshape(-1).to(torch.int8) for m in masks])
    if mask_meta is None and all(m.device.type == "cpu" for m in masks) and (
            positional is None or positional.device.type == "cpu"):
        # offsets, flags and masks in one host buffer: one copy (the masks ride as int64)
        by_position = (torch.zeros(batch, dtype=torch.int64) if positional is None
                       else positional.to(torch.int64))
        host = torch.cat([_mask_offsets(rows, cols), by_position, flat.to(torch.int64),
                          torch.zeros(1, dtype=torch.int64)])  # never an empty mask buffer
        on_device = host.to(device)
        mask_meta, flat = on_device[:5 * batch], on_device[5 * batch:].to(torch.int8)
    else:  # masks or flags already on the device: nothing of theirs comes back
        if mask_meta is None:
            by_position = (torch.zeros(batch, dtype=torch.int64, device=device)
                           if positional is None
                           else positional.to(device=device, dtype=torch.int64))
            mask_meta = torch.cat([_mask_offsets(rows, cols).to(device), by_position])
        else:  # the caller's copy of the offsets (a CUDA graph's buffer)
            assert positional is None and mask_meta.shape == (5 * batch,)
        flat = torch.cat([flat.to(device), torch.zeros(1, dtype=torch.int8, device=device)])
    window_value, softcap_value = _runtime(window, softcap)
    row_blocks = triton.cdiv(max(rows), extend_meta(head_dim, k_pool.dtype)["BLOCK_M"])
    meta = masked_meta(
        head_dim, k_pool.dtype, window=window, softcap=softcap,
        max_context=req_to_token.shape[1], num_programs=batch * num_q_heads * row_blocks,
        num_splits=num_splits, split_min=split_min,
    )  # fmt: skip
    mid_out, mid_lse = _split_buffers(q.shape[0], num_q_heads, head_dim, meta, device)
    grid = (batch, num_q_heads, row_blocks * meta["NUM_SPLITS"])
    k_arg, v_arg, ks_arg, vs_arg, stride_scale = _kv_args(k_pool, v_pool, k_scale, v_scale)
    tk.masked_kernel[grid](
        q, k_arg, v_arg, ks_arg, vs_arg, out, mid_out, mid_lse, req_to_token,
        req_pool_indices.to(device), prefix_lens.to(device), mask_meta, flat,
        sm_scale, window_value, softcap_value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), stride_scale, req_to_token.stride(0), batch,
        num_q_heads, num_q_heads // num_kv_heads, head_dim,
        **_kernel_meta(meta),
    )  # fmt: skip
    if meta["NUM_SPLITS"] > 1:
        _reduce_splits(mid_out, mid_lse, out, meta)
    return _output_for(out, k_pool)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] float, unit stride in V; bitmask [B, >= ceil(V/32)] int32.

    Token j of row b stays iff bit j % 32 of bitmask[b, j // 32] is set; else -inf.
    """
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.shape[1] * 32 >= vocab
    if batch == 0 or vocab == 0:
        return
    bitmask = _inner_contiguous(bitmask.to(device=logits.device, dtype=torch.int32))
    grid = (batch, triton.cdiv(vocab, _BITMASK_BLOCK))
    tk.token_bitmask_kernel[grid](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=_BITMASK_BLOCK
    )


def lora_meta(rank: int) -> dict[str, int]:
    """Block sizes of the LoRA kernels for stacked ranks up to `rank`."""
    return {"BLOCK_R": max(16, triton.next_power_of_2(rank)), "BLOCK_K": 64, "BLOCK_N": 64}


def lora_delta_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> None:
    """In place: y[t] += B[slots[t]] @ (A[slots[t]] @ x[t]) for every row t with a slot >= 0.

    y [T, N] (float32 / bf16 / f16, unit stride in N), x [T, K], slots int [T], a [S, R, K]
    and b [S, N, R] the batch's adapters stacked (zero-padded to the largest rank R; scale
    folded into B), as reference.lora_delta_ takes them."""
    tokens, n = y.shape
    s, rank, k = a.shape
    assert x.shape == (tokens, k) and b.shape == (s, n, rank) and slots.shape == (tokens,)
    if tokens == 0 or rank == 0:
        return
    x = _inner_contiguous(x)
    a, b = a.contiguous(), b.contiguous()
    slots = slots.to(device=y.device, dtype=torch.int64).contiguous()
    u = _empty((tokens, rank), torch.float32, y.device)
    meta = lora_meta(rank)
    tk.lora_shrink_kernel[(tokens, triton.cdiv(rank, meta["BLOCK_R"]))](
        x, a, slots, u, k, rank, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
        BLOCK_R=meta["BLOCK_R"], BLOCK_K=meta["BLOCK_K"],
    )
    tk.lora_expand_kernel[(tokens, triton.cdiv(n, meta["BLOCK_N"]))](
        u, b, slots, y, n, rank, u.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=meta["BLOCK_N"], BLOCK_R=meta["BLOCK_R"],
    )


class MoeAlignment(NamedTuple):
    """The (token, k) pairs of a routing grouped by expert for fused_moe_gemm_kernel.

    Pair p = t * top_k + k is token t's k-th choice; P = T * top_k.

    - sorted_pair_ids, int32 [max_padded]: expert 0's pairs in p order, padded with the id P
      to a multiple of block_m, then expert 1's, and so on (an expert with no pair has no
      entry); P everywhere past num_padded.
    - block_expert_ids, int32 [max_padded // block_m]: the expert of each block of block_m
      entries; -1 past num_padded.
    - num_padded, int64 [1] on the ids' device: the used length, a multiple of block_m.

    max_padded = block_m * cdiv(P + min(E, P) * (block_m - 1), block_m) bounds num_padded
    for any routing (an expert with pairs pads by at most block_m - 1), so a launch is sized
    from shapes alone and the host never waits for the count.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_padded: torch.Tensor


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the pairs of topk_ids [T, top_k] (int, each in 0..num_experts-1) by expert, each
    expert's run padded to a multiple of block_m (see MoeAlignment). Torch ops only, none of
    which syncs with the device: the stable argsort keeps each expert's pairs in p order."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    max_padded = block_m * triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1),
                                       block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    # the i-th sorted pair's rank within its expert, then its slot in the padded layout
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    slot = (padded_ends - padded)[expert_of] + rank
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[slot] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_pair_ids, block_expert, padded_ends[-1:].clone())


MOE_ACTIVATIONS = ("silu", "gelu_tanh")


def fused_moe_meta(num_pairs: int, num_experts: int, dtype: torch.dtype,
                   interpret: bool | None = None) -> dict[str, object]:
    """Constexprs of fused_moe_gemm_kernel (both GEMMs; MUL_ROUTING_WEIGHT is the launch's).
    BLOCK_M follows the mean pairs per expert (16 for decode, where most chosen experts get
    a row or two; up to 64 for prefill), so padding stays a small share of the rows."""
    dot = dot_dtype(dtype, interpret)
    mean_rows = triton.cdiv(max(num_pairs, 1), num_experts)
    return {
        "BLOCK_M": min(64, _block(mean_rows)),
        "BLOCK_N": 64,
        "BLOCK_K": 32 if dot == tl.float32 and not _resolve(interpret) else 64,
        "DOT_DTYPE": dot,
        # 64-row blocks (prefill) spilled with 4 warps on sm_90 and sm_80
        "num_warps": 8 if mean_rows > 32 else 4,
    }


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
              routing_weights: torch.Tensor | None, align: MoeAlignment, pairs_per_row: int,
              meta: dict[str, object]) -> None:
    """out [P, N] = per pair, a's row for it times its expert's w [E, N, K] transposed."""
    num_experts, n, k = w.shape
    grid = (align.block_expert_ids.shape[0], triton.cdiv(n, meta["BLOCK_N"]))
    tk.fused_moe_gemm_kernel[grid](
        a, w, out, out if routing_weights is None else routing_weights,
        align.sorted_pair_ids, align.block_expert_ids, align.num_padded,
        n, k, out.shape[0], pairs_per_row,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        MUL_ROUTING_WEIGHT=routing_weights is not None, **meta,
    )  # fmt: skip


def _gated(gate_up: torch.Tensor, inter: int, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up [P, 2 * inter] (gate then up), in its dtype."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]): float32 [T, H].

    x [T, H] (cast to the weights' dtype); w_gate_up [E, 2I, H] (each expert's gate rows,
    then its up rows) and w_down [E, H, I], float32 / bf16 / f16; topk_weights [T, top_k]
    float; topk_ids [T, top_k] int in 0..E-1. An expert is act(x W_gate^T) * (x W_up^T)
    times W_down^T, `activation` "silu" or "gelu_tanh" (reference.fused_moe_ref, as
    layers/moe.py's SparseMoE). The pairs are grouped by expert once (moe_align); the
    gate/up GEMM writes [T * top_k, 2I] in the weights' dtype, act * up runs in torch, the
    down GEMM scales each row by its weight into float32 [T * top_k, H], and each token's
    top_k rows are summed in k order.
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r} (supported: {MOE_ACTIVATIONS})")
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    top_k = topk_ids.shape[1]
    inter = two_inter // 2
    assert w_gate_up.shape == (num_experts, 2 * inter, hidden)
    assert w_down.shape == (num_experts, hidden, inter)
    assert topk_ids.shape == (tokens, top_k) and topk_weights.shape == (tokens, top_k)
    if tokens == 0:
        return torch.zeros(0, hidden, dtype=torch.float32, device=x.device)
    device = x.device
    x = _inner_contiguous(x.to(w_gate_up.dtype))
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    num_pairs = tokens * top_k
    meta = fused_moe_meta(num_pairs, num_experts, w_gate_up.dtype)
    align = moe_align(topk_ids.to(device), num_experts, meta["BLOCK_M"])
    gate_up = _empty((num_pairs, 2 * inter), w_gate_up.dtype, device)
    _moe_gemm(x, w_gate_up, gate_up, None, align, top_k, meta)
    act = _gated(gate_up, inter, activation).to(w_down.dtype)
    down = _empty((num_pairs, hidden), torch.float32, device)
    weights = topk_weights.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    _moe_gemm(act, w_down, down, weights, align, 1, meta)
    return down.view(tokens, top_k, hidden).sum(dim=1)
