"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder; their checkpoints fuse q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` (split here at load), scale RoPE with
`longrope` (layers/rotary.py) and, in Phi-4-mini, rotate only a leading part of each head
(`partial_rotary_factor`): those q/k rows are put in the order a full rotation expects."""

from __future__ import annotations

from typing import Any

import torch

from sglang_like.config import ModelConfig
from sglang_like.layers.rotary import partial_rotary_order
from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["Phi3ForCausalLM", "take_rows"]


def take_rows(weight: Any, rows: torch.Tensor) -> Any:
    """Rows of a dense tensor or of a packed GGUF matrix (`GGUFBlockWeight.take_rows`)."""
    if isinstance(weight, torch.Tensor):
        return weight.index_select(0, rows)
    return weight.take_rows(rows)


def split_fused(config: ModelConfig, weights: dict[str, Any], prefix: str) -> None:
    """`{prefix}self_attn.qkv_proj` / `mlp.gate_up_proj` (weight and bias) into their parts."""
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    for fused, parts in ((f"{prefix}self_attn.qkv_proj", (("q_proj", q), ("k_proj", kv),
                                                           ("v_proj", kv))),
                         (f"{prefix}mlp.gate_up_proj", (("gate_proj", inter),
                                                        ("up_proj", inter)))):
        for kind in ("weight", "bias"):
            tensor = weights.pop(f"{fused}.{kind}", None)
            if tensor is None:
                continue
            start, owner = 0, fused.rpartition(".")[0]
            if tensor.shape[0] != sum(n for _, n in parts):
                raise ValueError(f"{fused}.{kind}: {tensor.shape[0]} rows, want "
                                 f"{sum(n for _, n in parts)}")
            for name, n in parts:
                weights[f"{owner}.{name}.{kind}"] = take_rows(tensor, torch.arange(start,
                                                                                   start + n))
                start += n


def order_partial_rotary(config: ModelConfig, weights: dict[str, Any]) -> None:
    """Each head's q/k rows in `partial_rotary_order` (a no-op for a full rotation)."""
    hd, rd = config.head_dim, config.rotary_dim
    if rd is None or rd == hd:
        return
    order = partial_rotary_order(hd, rd)
    for i in range(config.num_hidden_layers):
        for proj, heads in (("q_proj", config.num_attention_heads),
                            ("k_proj", config.num_key_value_heads)):
            rows = (torch.arange(heads)[:, None] * hd + order[None, :]).reshape(-1)
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                if name in weights:
                    weights[name] = take_rows(weights[name], rows)


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_hf_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> None:
        for i in range(config.num_hidden_layers):
            split_fused(config, weights, f"model.layers.{i}.")
        order_partial_rotary(config, weights)
