"""OLMoE: pre-norm layers whose attention norms each token's whole q (and k) projection, all
heads at once, before RoPE (as OLMo 2 does), and whose every MLP is a mixture of experts with
unnormalized top-k weights."""

from __future__ import annotations

from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["OlmoeForCausalLM"]


class OlmoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        return DecoderLayerDescription(
            norm_eps=config.rms_norm_eps, qk_norm="full",
            has_qkv_bias=config.attention_bias, has_o_bias=config.attention_bias,
            activation=config.hidden_act, sliding_window=config.layer_window(layer_id),
            mlp="moe" if config.layer_is_moe(layer_id) else "dense")
