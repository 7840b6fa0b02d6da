"""torch-facing wrappers of the fused decode-step ops in ops.c (CPU tensors only).

Each takes and returns contiguous CPU tensors; activations are float32 or bfloat16 as the
caller's next matmul wants (`out_dtype`), the residual stream is float32, the KV pool float32
or bfloat16. They are the model's decode path when `kernels.cpu.available()`.
"""

from __future__ import annotations

import torch

from kernels.cpu import _lib

__all__ = ["add_rmsnorm", "decode_attention_rope", "rmsnorm", "silu_mul"]

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
