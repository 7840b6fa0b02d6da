"""ForwardBatch: everything one model forward needs, as tensors, built by the model runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """One forward over B requests: each contributes `extend_lens[b]` new tokens after its
    `prefix_lens[b]` cached ones (a decode step is an extend of 1; a verify pass is an extend of
    N draft tokens with `tree_mask`).

    Token rows are packed in request order: request b's new tokens are rows
    [extend_start_loc[b], extend_start_loc[b] + extend_lens[b]).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: KV slot each new token's K/V is written to
    req_pool_indices: torch.Tensor  # [B] int64: row of req_to_token
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [L] int64: token rows whose logits the caller wants
    req_to_token: torch.Tensor  # [num_rows, max_context] int32 (the pool's table)
    tree_mask: torch.Tensor | None = None  # [B, N, N] bool for speculative verify
    # per request, bool [extend_len, m]: its queries see the first prefix_len keys and key
    # prefix_len + j iff mask[i, j] (trees of any size beside causal extends; see
    # sglang_like_kernels.masked_attention). Positions are then given, not derived.
    custom_masks: list[torch.Tensor] | None = None
    # per request of custom_masks: True for an extend whose mask lets rows see later keys (an
    # image's rows both ways, Gemma 3), windowed by position; None: no such request
    positional_masks: torch.Tensor | None = None  # bool [B]
    # custom_masks' offsets already on the device (triton_ops.masked_offsets): a CUDA graph's
    # draft step, which cannot copy them from the host at each replay; None: built per call
    custom_mask_meta: torch.Tensor | None = None
    is_decode: bool = False  # every extend_len == 1 and no tree mask
    # called with i once layer i has stored this batch's K/V (prefill/decode disaggregation
    # streams each layer's KV out while the next layers compute); None: no hook
    on_layer: Callable[[int], None] | None = None
    # rows of requests on LoRA adapters, by adapter (layers.lora); None: all on the base
    lora: Any = None  # a layers.lora.LoraBatch
    # images: token rows whose embeddings are image embedding rows instead of their ids'
    # (a vision-language model's prefill); None: every row embeds its id
    image_rows: torch.Tensor | None = None  # [K] int64
    image_embeds: torch.Tensor | None = None  # [K, hidden]
    # max(extend_lens), known on the host (a kernel's grid needs it; reading it back from the
    # device would be a sync per layer); None: the kernel reads it
    max_extend_len: int | None = None
    seq_lens: torch.Tensor = field(init=False)  # [B] prefix + extend, built once per forward

    def __post_init__(self) -> None:
        # one tensor for every layer's attention call (the CPU decode path memoizes on it)
        self.seq_lens = self.prefix_lens + self.extend_lens

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

