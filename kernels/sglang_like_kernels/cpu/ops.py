"""torch-facing wrappers of the fused decode-step ops in ops.c (CPU tensors only).

Each takes and returns contiguous CPU tensors; activations are float32 or bfloat16 as the
caller's next matmul wants (`out_dtype`), the residual stream is float32, the KV pool float32
or bfloat16. They are the model's decode path when `sglang_like_kernels.cpu.available()`.
"""

from __future__ import annotations

import torch

from sglang_like_kernels.cpu import _lib

__all__ = ["add_rmsnorm", "argmax_rows", "decode_attention_rope", "decode_step_x16",
           "eagle_head_x16", "rmsnorm", "silu_mul"]

_FLAGS = {torch.float32: 0, torch.bfloat16: 1}


def _flag(dtype: torch.dtype) -> int:
    try:
        return _FLAGS[dtype]
    except KeyError:
        raise TypeError(f"native CPU ops take float32 or bfloat16, not {dtype}") from None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype) -> torch.Tensor:
    """rmsnorm(x) * weight: x float32 [T, H] -> [T, H] in out_dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    _lib(None).add_rmsnorm(x.data_ptr(), None, 0, None, weight.data_ptr(), x.shape[0],
                           x.shape[1], eps, out.data_ptr(), _flag(out_dtype))
    return out


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta) * weight): the residual add and the next norm in one
    pass; x float32 [T, H], delta float32 or bfloat16 (a sub-layer's output as it comes)."""
    x, delta = x.contiguous(), delta.contiguous()
    x_out = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=out_dtype)
    _lib(None).add_rmsnorm(x.data_ptr(), delta.data_ptr(), _flag(delta.dtype), x_out.data_ptr(),
                           weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                           _flag(out_dtype))
    return x_out, out


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] projection -> [T, I]."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=out_dtype)
    _lib(None).silu_mul(gate_up.data_ptr(), _flag(gate_up.dtype), t, two_i // 2, out.data_ptr(),
                        _flag(out_dtype))
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() of a float32 [R, N] matrix whose rows are contiguous
    (any row stride): the first maximum of each row, a NaN counting as the maximum. torch's
    CPU argmax is slow on a batch's logits (docs/cpu-kernels.md); this reads from cache at
    SIMD width and splits rows over the team."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise TypeError("argmax_rows takes a float32 [R, N] matrix with contiguous rows")
    r, n = x.shape
    if n == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(r, dtype=torch.int64)
    if r:
        _lib(None).argmax_rows(x.data_ptr(), x.stride(0), r, n, out.data_ptr())
    return out.tolist()


def decode_attention_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                          cos_table: torch.Tensor, sin_table: torch.Tensor,
                          positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          out_slots: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          sm_scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """One decode step's attention from the fused qkv [B, (Hq + 2 Hkv) * D]: RoPE on q and k
    (tables [P, D]: [cos, cos] and [-sin, sin] rows), k/v stored at `out_slots`, then each
    query over its request's first seq_len slots. Returns [B, Hq * D] in out_dtype."""
    qkv = qkv.contiguous()
    b = qkv.shape[0]
    out = torch.empty(b, num_heads * head_dim, dtype=out_dtype)
    if b == 0:
        return out
    if req_to_token.dtype != torch.int32 or not req_to_token.is_contiguous():
        raise TypeError("req_to_token must be a contiguous int32 table")
    rc = _lib(None).decode_attention_rope(
        qkv.data_ptr(), _flag(qkv.dtype), b, num_heads, num_kv_heads, head_dim,
        cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(), k_pool.data_ptr(),
        v_pool.data_ptr(), _flag(k_pool.dtype), out_slots.data_ptr(), req_to_token.data_ptr(),
        req_to_token.stride(0), req_pool_indices.data_ptr(), seq_lens.data_ptr(), sm_scale,
        out.data_ptr(), _flag(out_dtype))
    if rc != 0:
        raise MemoryError("decode_attention_rope could not allocate its scratch memory")
    return out


def _int64(name: str, t: torch.Tensor) -> int:
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous int64 tensor")
    return t.data_ptr()


DECODE_STEP_RUNS = 4  # decode_step.c's DS_RUNS


def decode_step_x16(num_layers: int, x: torch.Tensor, ptrs: torch.Tensor, eps: float,
                    pool_dtype: torch.dtype, cos_table: torch.Tensor, sin_table: torch.Tensor,
                    positions: torch.Tensor, out_slots: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, intermediate: int, sm_scale: float,
                    aux_slot: torch.Tensor, features: torch.Tensor | None,
                    variant: str | None = None, runs: torch.Tensor | None = None) -> None:
    """Every layer of a decode or verify step (decode_step.c), x float32 [T, H] updated in
    place from the embedded rows to the residual stream after the last layer. `ptrs` int64
    [L, 8]: addresses of each layer's x16 qkv, o, gate_up and down weights, its two float32
    norm weights, its K and V pool buffers (of `pool_dtype`). Query row t attends to the first
    seq_lens[t] slots of table[rows[t]] (int32 table) and stores its k/v at out_slots[t].
    aux_slot int64 [L]: -1 or the column block of `features` [T, n * H] that receives the
    residual stream entering that layer. `variant`: the build to run (default: this CPU's).
    `runs` int64 [L, 4, DECODE_STEP_RUNS, 3] (GGUF types): each linear as runs of output rows
    (kind of kquants.c or -1 for x16, weight address, rows; rows 0 ends a linear), in place
    of ptrs' weight addresses."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise TypeError("x must be a contiguous float32 tensor")
    if table.dtype != torch.int32 or table.stride(-1) != 1:
        raise TypeError("the key table must be int32 with contiguous rows")
    if tuple(ptrs.shape) != (num_layers, 8):
        raise ValueError(f"ptrs must be [{num_layers}, 8]")
    t, h = x.shape
    if t == 0:
        return
    n_aux = 0 if features is None else features.shape[1] // h
    rc = _lib(variant).decode_step_x16(
        num_layers, t, h, num_heads, num_kv_heads, head_dim, intermediate, x.data_ptr(),
        _int64("ptrs", ptrs), eps, _flag(pool_dtype), cos_table.data_ptr(),
        sin_table.data_ptr(), _int64("positions", positions), _int64("out_slots", out_slots),
        table.data_ptr(), table.stride(0), _int64("rows", rows), _int64("seq_lens", seq_lens),
        sm_scale, _int64("aux_slot", aux_slot), n_aux,
        None if features is None else features.data_ptr(),
        None if runs is None else _int64("runs", runs))
    if rc == -2:
        raise ValueError(f"decode_step_x16 cannot take these shapes (H={h}, heads {num_heads}/"
                         f"{num_kv_heads}x{head_dim}, intermediate {intermediate})")
    if rc != 0:
        raise MemoryError("decode_step_x16 could not allocate its scratch memory")


def eagle_head_x16(embeds: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   features: torch.Tensor, ptrs: torch.Tensor, eps: float,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                   out_slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                   vocab: int, sm_scale: float, logit_rows: torch.Tensor, d2t: torch.Tensor,
                   topk: int, variant: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's forward, its LM head and the top-k of its draft distribution in one
    call (eagle_head.c): (out float32 [T, H], the layer's output; target ids int64 [R, topk]
    and their log-probabilities float32 [R, topk], largest first, for rows `logit_rows` of
    out). `embeds`: the rows' embeddings float32 [T, H], or (codes, scale, ids int64 [T]) to
    embed them from the target's int8 rows: codes int8 [V, H] and scale float32 [V, H / 32],
    or the q8 x16 layout's (`q8_x16_pack`: 5-d codes). features float32
    [T, F]: the target's features when ptrs[0] (fc) is set, else the head's own outputs
    (F == H). ptrs int64 [10]: x16 fc, qkv, o, gate_up, down, lm_head weights, float32 norms
    of the embedding, the hidden input, post-attention and the output. d2t int64 [vocab]:
    draft id d is target id d + d2t[d]. Attention as `decode_step_x16`'s, over the head's
    one-layer pool."""
    if isinstance(embeds, tuple):
        codes, scale, ids = embeds
        if codes.dtype != torch.int8 or scale.dtype != torch.float32 or not (
                codes.is_contiguous() and scale.is_contiguous()):
            raise TypeError("the embedding must be contiguous int8 codes and float32 scales")
        x16 = codes.dim() == 5
        t, h = len(ids), (codes.shape[1] * 32 if x16 else codes.shape[1])
        if (scale.shape[-1] if not x16 else scale.shape[1]) * 32 != h:
            raise ValueError("the embedding's scales must be one per 32 columns")
        emb_args = (None, codes.data_ptr(), scale.data_ptr(), int(x16), _int64("ids", ids))
    else:
        if embeds.dtype != torch.float32 or not embeds.is_contiguous():
            raise TypeError("embeds must be a contiguous float32 tensor")
        t, h = embeds.shape
        emb_args = (embeds.data_ptr(), None, None, 0, None)
    if features.dtype != torch.float32 or not features.is_contiguous():
        raise TypeError("features must be a contiguous float32 tensor")
    if table.dtype != torch.int32 or table.stride(-1) != 1:
        raise TypeError("the key table must be int32 with contiguous rows")
    if tuple(ptrs.shape) != (10,) or tuple(d2t.shape) != (vocab,):
        raise ValueError(f"ptrs must be [10] and d2t [{vocab}]")
    out = torch.empty(t, h)
    top_ids = torch.empty(len(logit_rows), topk, dtype=torch.int64)
    top_lp = torch.empty(len(logit_rows), topk)
    if t == 0:
        return out, top_ids, top_lp
    rc = _lib(variant).eagle_head_x16(
        t, h, num_heads, num_kv_heads, head_dim, intermediate, vocab, features.shape[1],
        *emb_args, features.data_ptr(), _int64("ptrs", ptrs), eps, cos_table.data_ptr(),
        sin_table.data_ptr(), _int64("positions", positions), _int64("out_slots", out_slots),
        k_pool.data_ptr(), v_pool.data_ptr(), _flag(k_pool.dtype), table.data_ptr(),
        table.stride(0), _int64("rows", rows), _int64("seq_lens", seq_lens), sm_scale,
        out.data_ptr(), _int64("logit_rows", logit_rows), len(logit_rows), _int64("d2t", d2t),
        topk, top_ids.data_ptr(), top_lp.data_ptr())
    if rc == -2:
        raise ValueError(f"eagle_head_x16 cannot take these shapes (H={h}, features "
                         f"{features.shape[1]}, heads {num_heads}/{num_kv_heads}x{head_dim}, "
                         f"intermediate {intermediate}, vocab {vocab}, top-{topk})")
    if rc != 0:
        raise MemoryError("eagle_head_x16 could not allocate its scratch memory")
    return out, top_ids, top_lp
