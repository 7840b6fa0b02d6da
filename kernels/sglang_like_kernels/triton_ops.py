"""Triton launchers: shapes, block sizes and grids for the kernels in triton_kernels.

The launchers take the same arguments as reference.py. They run on CUDA tensors, and
on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
Each ``*_meta`` helper returns the compile-time constants its launcher uses, so the
ahead-of-time compile test builds exactly what runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang_like_kernels import kv_quant
from sglang_like_kernels import triton_kernels as tk
from sglang_like_kernels.reference import check_window_softcap

__all__ = [
    "apply_token_bitmask_",
    "lora_delta_",
    "lora_meta",
    "decode_attention",
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
_MAX_DECODE_SPLITS = 16
_DECODE_SPLIT_TOKENS = 256
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
) -> dict[str, object]:
    """Constexprs of decode_split_kernel (decode_reduce_kernel takes NUM_SPLITS, BLOCK_S,
    BLOCK_D from the same dict). A window caps the keys a request reads, so the splits."""
    dtype = dot_dtype(pool_dtype, interpret)
    if num_splits is None:
        keys = max_context if window is None else min(max_context, window)
        num_splits = min(_MAX_DECODE_SPLITS, max(1, triton.cdiv(keys, _DECODE_SPLIT_TOKENS)))
    return {
        "NUM_SPLITS": num_splits,
        "BLOCK_G": _block(num_q_heads // num_kv_heads),
        "BLOCK_N": _tile(dtype, interpret),
        "BLOCK_D": _block(head_dim),
        "DOT_DTYPE": dtype,
        "BLOCK_S": triton.next_power_of_2(num_splits),
        **_flags(window, softcap, pool_dtype),
    }


def extend_meta(
    head_dim: int, pool_dtype: torch.dtype, interpret: bool | None = None,
    window: int | None = None, softcap: float | None = None,
) -> dict[str, object]:
    """Constexprs of extend_kernel."""
    dtype = dot_dtype(pool_dtype, interpret)
    block = _tile(dtype, interpret)
    return {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": _block(head_dim), "DOT_DTYPE": dtype,
            **_flags(window, softcap, pool_dtype)}


def tree_verify_meta(
    num_draft: int, head_dim: int, pool_dtype: torch.dtype, interpret: bool | None = None,
    window: int | None = None, softcap: float | None = None,
) -> dict[str, object]:
    """Constexprs of tree_verify_kernel."""
    dtype = dot_dtype(pool_dtype, interpret)
    return {
        "BLOCK_M": _block(num_draft),
        "BLOCK_N": _tile(dtype, interpret),
        "BLOCK_D": _block(head_dim),
        "DOT_DTYPE": dtype,
        **_flags(window, softcap, pool_dtype),
    }


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and scratch buffer comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


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
) -> torch.Tensor:
    """Flash-decoding: one query per request over its cached tokens.

    q: [B, Hq, D]; k_pool, v_pool: [num_slots, Hkv, D] contiguous, Hq % Hkv == 0;
    req_to_token: [max_requests, max_context] int32; req_pool_indices, seq_lens: [B] int
    (seq_lens >= 1). Returns [B, Hq, D] in q's dtype. The visible keys of each request (its
    last `window`, or all) are cut into num_splits pieces (default from max_context and the
    window) scored in parallel, then merged. `softcap`: scores -> cap * tanh(scores / cap).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.stride() == v_pool.stride()
    out = _empty(q.shape, q.dtype, q.device)
    if batch == 0:
        return out
    q = _inner_contiguous(q)
    window_value, softcap_value = _runtime(window, softcap)
    meta = decode_meta(
        num_q_heads, num_kv_heads, head_dim, req_to_token.shape[1], k_pool.dtype, num_splits,
        window=window, softcap=softcap,
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
        USE_SOFTCAP=meta["USE_SOFTCAP"], KV_KIND=meta["KV_KIND"],
    )  # fmt: skip
    tk.decode_reduce_kernel[(batch, num_q_heads)](
        mid_out, mid_lse, out,
        out.stride(0), out.stride(1),
        num_q_heads, head_dim,
        NUM_SPLITS=splits, BLOCK_S=meta["BLOCK_S"], BLOCK_D=meta["BLOCK_D"],
    )  # fmt: skip
    return out


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
) -> torch.Tensor:
    """Causal attention of packed new tokens over prefix + themselves (the token at
    position p over p - window < j <= p with a `window`; scores soft-capped with `softcap`).

    q: [T, Hq, D], request b's extend_lens[b] rows contiguous in batch order; their K/V
    are at req_to_token[req_pool_indices[b], prefix_lens[b] : prefix_lens[b] +
    extend_lens[b]]; k_pool, v_pool: [num_slots, Hkv, D]; prefix_lens, extend_lens: [B]
    int (CPU or device; the max extend length is read on the host). Returns [T, Hq, D]
    in q's dtype.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and k_pool.stride() == v_pool.stride()
    out = _empty(q.shape, q.dtype, q.device)
    batch = extend_lens.shape[0]
    max_extend = int(extend_lens.max()) if batch else 0
    if max_extend == 0:
        return out
    q = _inner_contiguous(q)
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
    return out


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
) -> torch.Tensor:
    """Speculative verify: N draft tokens per request over the prefix and their tree.

    q: [B*N, Hq, D]; draft K/V at positions prefix_lens[b]..prefix_lens[b]+N-1 of row
    req_pool_indices[b]; tree_mask: bool [B, N, N] (draft query i sees draft key j iff
    tree_mask[b, i, j]); prefix_lens: [B] int. With a `window` each query keeps the last
    `window` of its visible keys in position order; `softcap` caps the scores. Returns
    [B*N, Hq, D] in q's dtype.
    """
    batch, num_draft, _ = tree_mask.shape
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    assert q.shape[0] == batch * num_draft and num_q_heads % num_kv_heads == 0
    out = _empty(q.shape, q.dtype, q.device)
    if batch == 0 or num_draft == 0:
        return out
    q = _inner_contiguous(q)
    device = q.device
    mask = tree_mask.to(device=device, dtype=torch.int8).contiguous()
    window_value, softcap_value = _runtime(window, softcap)
    k_arg, v_arg, ks_arg, vs_arg, stride_scale = _kv_args(k_pool, v_pool, k_scale, v_scale)
    tk.tree_verify_kernel[(batch, num_q_heads)](
        q, k_arg, v_arg, ks_arg, vs_arg, out, req_to_token, req_pool_indices.to(device),
        prefix_lens.to(device), mask,
        sm_scale, window_value, softcap_value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), stride_scale, req_to_token.stride(0),
        num_draft, num_q_heads // num_kv_heads, head_dim,
        **tree_verify_meta(num_draft, head_dim, k_pool.dtype, window=window, softcap=softcap),
    )  # fmt: skip
    return out


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
