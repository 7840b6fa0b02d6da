"""OLMo 2: the Llama decoder with norms after the sub-layers instead of before them, and an
RMSNorm over each token's whole q (and k) projection, all heads at once, before RoPE."""

from __future__ import annotations

from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["Olmo2ForCausalLM"]


class Olmo2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        return DecoderLayerDescription(
            norm_eps=config.rms_norm_eps, norm_layout="post", qk_norm="full",
            has_qkv_bias=config.attention_bias, has_o_bias=config.attention_bias,
            sliding_window=config.layer_window(layer_id))
