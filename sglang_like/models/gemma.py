"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

All three: GeGLU (gelu's tanh approximation), embeddings scaled by sqrt(hidden), norms that
multiply by 1 + w (folded into w at load; llama.cpp's converter has already folded it into a
GGUF's norms). Gemma 2 and 3: sandwich norms (attention's and the MLP's outputs normed before
the residual add), scores scaled by query_pre_attn_scalar ** -0.5, sliding-window layers
beside global ones. Gemma 2: tanh soft-caps on the scores and the logits. Gemma 3: q/k norms
per head, and its sliding layers rotate with a base of their own (rope_local_base_freq).
"""

from __future__ import annotations

from typing import Any

from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["GemmaForCausalLM"]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 / 2 / 3 text, told apart by `config.architecture`."""

    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        gen = generation(config.architecture)
        window = config.layer_window(layer_id)
        return DecoderLayerDescription(
            norm_eps=config.rms_norm_eps, activation="gelu_tanh",
            norm_layout="pre" if gen == 1 else "sandwich",
            qk_norm="head" if config.qk_norm else None,
            has_qkv_bias=config.attention_bias, has_o_bias=config.attention_bias,
            rope="local" if gen == 3 and window is not None else "global",
            sliding_window=window, attn_logit_softcap=config.attn_logit_softcap)

    @classmethod
    def adapt_hf_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> None:
        for name, tensor in weights.items():
            if name.endswith("norm.weight"):  # Gemma's norms multiply by (1 + w)
                weights[name] = tensor.float() + 1.0


def generation(architecture: str) -> int:
    """1, 2 or 3 from a model_type or GGUF architecture name."""
    return {"gemma": 1, "gemma2": 2, "gemma3": 3, "gemma3_text": 3}[architecture]
