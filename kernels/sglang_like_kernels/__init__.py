"""Attention and masking kernels over the token-granular KV pool.

Each public function runs the Triton launcher (``triton_ops``) when its tensors are on CUDA
and the torch reference (``reference``) otherwise. Triton is imported only
when a launcher first runs, so CPU users never pay for it.

The environment variable ``SGLANG_LIKE_KERNELS`` overrides that choice; it is read once, when
this package is imported:

- ``auto`` (default, also when unset or empty): by the device of the tensors, as above;
- ``triton``: the Triton launchers for every tensor. On CPU tensors this needs
  ``TRITON_INTERPRET=1`` set before triton is imported (tests of the whole model);
- ``reference``: the torch references for every tensor, CUDA included.

Any other value is a ValueError at import.

A quantized pool (int8 / fp8 codes, ``kv_quant``) is passed with its scales, ``k_scale`` /
``v_scale`` [num_slots, num_kv_heads] float32, to ``store_kv`` and every attention.

Every attention takes ``window`` and ``softcap`` (None: off), as transformers' Mistral and
Gemma 2/3 compute them: scores ``s = (q . k) * sm_scale`` become ``softcap * tanh(s / softcap)``
before the mask, and a query at position p sees only the keys at p - window < j <= p (itself
and the window - 1 before it). Under a tree mask a query keeps the last ``window`` of its
visible keys in position order (its path), which is the same rule.

KV layout, per layer: ``k_pool``/``v_pool`` [num_slots, num_kv_heads, head_dim] (slot 0 is
padding, never owned by a request); ``req_to_token`` [max_requests, max_context] int32 maps
(request pool row, position) -> slot id.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from sglang_like_kernels import reference

__all__ = [
    "apply_token_bitmask_",
    "decode_attention",
    "extend_attention",
    "masked_attention",
    "store_kv",
    "tree_verify_attention",
]


_ENV_VAR = "SGLANG_LIKE_KERNELS"
_MODES = ("auto", "triton", "reference")


def _read_mode() -> str:
    mode = os.environ.get(_ENV_VAR, "").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{_ENV_VAR}={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


_MODE = _read_mode()
_triton_ops: ModuleType | None = None


def _triton() -> ModuleType:
    global _triton_ops
    if _triton_ops is None:
        from sglang_like_kernels import triton_ops

        _triton_ops = triton_ops
    return _triton_ops


def _backend(tensor: torch.Tensor) -> ModuleType:
    """The module that runs a call on `tensor` (hot path: a string compare and a flag)."""
    if _MODE == "auto":
        return _triton() if tensor.is_cuda else reference
    return reference if _MODE == "reference" else _triton()


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, Hkv, D] into k_pool/v_pool rows slot_ids [T] int64, cast to pool dtype
    (a quantized pool: codes, and the rows' scales into k_scale / v_scale)."""
    _backend(k_pool).store_kv(k_pool, v_pool, slot_ids, k, v, k_scale, v_scale)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] (query at position seq_len-1, K/V already stored).

    req_pool_indices, seq_lens [B] int64. Returns [B, Hq, D] in q's dtype. GQA: query head
    h reads kv head h // (Hq // Hkv).
    """
    return _backend(q).decode_attention(
        q, k_pool, v_pool, req_to_token, req_pool_indices, seq_lens, sm_scale,
        window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )


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
    """Prefill/extend attention: q [T, Hq, D] packed by request in batch order.

    Request b's extend_lens[b] new K/V are stored at req_to_token[r, prefix_lens[b] :
    prefix_lens[b] + extend_lens[b]]; its query i attends to keys 0..prefix_lens[b]+i.
    prefix_lens, extend_lens [B] int64 (CPU or device). Returns [T, Hq, D] in q's dtype.
    `max_extend_len`: max(extend_lens) when the caller knows it (else the Triton launcher
    reads it back from the device, a sync per call).
    """
    return _backend(q).extend_attention(
        q, k_pool, v_pool, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale,
        window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        max_extend_len=max_extend_len,
    )


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
    """Speculative verify: q [B*N, Hq, D], N draft tokens per request.

    Draft K/V are stored at positions prefix_len..prefix_len+N-1; query i attends to every
    prefix key and to draft key j iff tree_mask[b, i, j] (bool [B, N, N], diagonal true).
    Returns [B*N, Hq, D] in q's dtype.
    """
    return _backend(q).tree_verify_attention(
        q, k_pool, v_pool, req_to_token, req_pool_indices, prefix_lens, tree_mask, sm_scale,
        window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )


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
    mask_meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention under a per-request mask (ragged trees mixed with extends): request b's
    masks[b].shape[0] packed queries see its first prefix_lens[b] keys and key
    prefix_lens[b] + j iff masks[b][i, j]; `positional` (reference.masked_attention): extends
    whose masks see later keys, windowed by position. On CUDA the Triton kernel takes the
    masks ragged, as they come (a uniform verify batch goes through `tree_verify_attention`);
    `mask_meta` (`triton_ops.masked_offsets` of the masks' shapes) spares it the offsets'
    copy from the host, which a CUDA graph cannot replay (the reference reads the masks)."""
    return _backend(q).masked_attention(
        q, k_pool, v_pool, req_to_token, req_pool_indices, prefix_lens, masks, sm_scale,
        window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        positional=positional, mask_meta=mask_meta,
    )


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] float; bitmask [B, ceil(V/32)] int32 (little-endian bits).

    Bit j % 32 of word j // 32 set means token j is allowed; other tokens become -inf.
    """
    _backend(logits).apply_token_bitmask_(logits, bitmask)
