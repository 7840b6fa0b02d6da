"""The loader's result type and the weight-name/shape contract every loader meets."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sglang_like.config import ModelConfig
from sglang_like.tokenizer import Tokenizer


class LoadedModel(NamedTuple):
    """A model ready for the runner: its config, HF-named [out, in] weights and tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer


_LAYOUT_NORMS = {  # a norm layout's norms (layers/decoder.py), by their Hugging Face names
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight (biases included when the config has them) a model of `config` needs, as
    its family's layer descriptions lay the layers out."""
    from sglang_like.models.registry import model_class

    describe = model_class(config.architecture).layer_description
    h, hd = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        desc = describe(config, i)
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, h),
            p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h),
            p + "self_attn.o_proj.weight": (h, q_rows),
        }
        shapes |= _mlp_shapes(config, desc, p)
        shapes |= {f"{p}{norm}.weight": (h,) for norm in _LAYOUT_NORMS[desc.norm_layout]}
        if desc.has_qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
        if desc.has_o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if desc.qk_norm is not None:
            q_n, k_n = (hd, hd) if desc.qk_norm == "head" else (q_rows, kv_rows)
            shapes |= {p + "self_attn.q_norm.weight": (q_n,),
                       p + "self_attn.k_norm.weight": (k_n,)}
    return shapes


def _gated(prefix: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
            prefix + "down_proj.weight": (h, inter)}


def _mlp_shapes(config: ModelConfig, desc: Any, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP weights: one gated MLP, or a router, its experts and a shared expert."""
    h = config.hidden_size
    if desc.mlp == "dense":
        return _gated(p + "mlp.", h, config.intermediate_size)
    shapes = {p + "mlp.gate.weight": (config.num_experts, h)}
    for j in range(config.num_experts):
        shapes |= _gated(f"{p}mlp.experts.{j}.", h, config.moe_intermediate_size)
    if config.shared_expert_intermediate_size:
        shapes |= _gated(p + "mlp.shared_expert.", h, config.shared_expert_intermediate_size)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError when a needed weight is missing or has the wrong shape."""
    for name, shape in expected_weight_shapes(config).items():
        if name not in weights:
            raise ValueError(f"checkpoint {config.model_path!r} lacks weight {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(weights[name].shape)}, config implies {shape}"
            )
