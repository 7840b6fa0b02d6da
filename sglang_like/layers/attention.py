"""Attention over the token-granular KV pool: one interface, the backend the batch calls for.

`Attention` stores a layer's new K/V at the batch's slots and attends. The backends are
`sglang_like_kernels`' functions (the Triton launcher on CUDA tensors, the torch reference
elsewhere; `SGLANG_LIKE_KERNELS` overrides). The native CPU path runs attention inside the
fused decode step instead (`layers.native_decode`), which reads the same pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import sglang_like_kernels

if TYPE_CHECKING:
    from sglang_like.forward_batch import ForwardBatch
    from sglang_like.mem_pool import KVPool


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, fb: ForwardBatch,
           sm_scale: float, window: int | None = None,
           softcap: float | None = None, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The attention kernel this forward's shape calls for (K/V of its tokens stored):
    per-request masks (a verify beside decode rows), one uniform tree mask (a CUDA verify),
    a decode batch, or a causal extend. q [T, Hq, D] -> [T, Hq, D]. `window`: a query sees
    only the last `window` keys of its visible ones (itself included); `softcap`: scores ->
    cap * tanh(scores / cap) before the mask (None: off; sglang_like_kernels). `k_scale` /
    `v_scale`: a quantized pool's scales (KVPool.layer)."""
    kw = {"window": window, "softcap": softcap, "k_scale": k_scale, "v_scale": v_scale}
    if fb.custom_masks is not None:
        return sglang_like_kernels.masked_attention(
            q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
            fb.custom_masks, sm_scale, positional=fb.positional_masks,
            mask_meta=fb.custom_mask_meta, **kw)
    if fb.tree_mask is not None:
        return sglang_like_kernels.tree_verify_attention(
            q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
            fb.tree_mask, sm_scale, **kw)
    if fb.is_decode:
        return sglang_like_kernels.decode_attention(
            q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, sm_scale,
            **kw)
    return sglang_like_kernels.extend_attention(
        q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
        fb.extend_lens, sm_scale, max_extend_len=fb.max_extend_len, **kw)


class Attention:
    """One layer's attention over the pool: K/V stored at `fb.out_slots`, then `attend`.

    Holds no weights (the projections are the model's); `layer_id` picks the pool's buffers.
    `window` / `softcap`: the layer's sliding window and score soft-cap (see `attend`).
    """

    def __init__(self, layer_id: int, sm_scale: float, window: int | None = None,
                 softcap: float | None = None) -> None:
        self.layer_id = layer_id
        self.sm_scale = sm_scale
        self.window = window
        self.softcap = softcap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                 pool: KVPool) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        i = self.layer_id
        k_pool, v_pool = pool.k_buffers[i], pool.v_buffers[i]
        k_scale = None if pool.k_scales is None else pool.k_scales[i]  # a quantized pool's
        v_scale = None if pool.v_scales is None else pool.v_scales[i]
        sglang_like_kernels.store_kv(k_pool, v_pool, fb.out_slots, k, v, k_scale, v_scale)
        return attend(q, k_pool, v_pool, fb, self.sm_scale, self.window, self.softcap,
                      k_scale, v_scale)
