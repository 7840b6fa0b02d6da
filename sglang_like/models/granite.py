"""Granite 3.x: the Llama decoder with four multipliers from its config: on the embeddings
(`embedding_multiplier`), on each sub-layer's output before the residual add
(`residual_multiplier`), as the attention's score scale (`attention_multiplier`, in place of
head_dim ** -0.5) and on the logits (1 / `logits_scaling`). The loaders put them in
`ModelConfig`; the layers here read the residual one."""

from __future__ import annotations

from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.models.llama import LlamaForCausalLM, layer_description

__all__ = ["GraniteForCausalLM"]


class GraniteForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        # Llama's layer; residual_scale comes from the config there
        return layer_description(config, layer_id)
