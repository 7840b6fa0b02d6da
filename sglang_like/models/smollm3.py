"""SmolLM3: the Llama decoder where some layers (every fourth in the released model) attend
without rotary position embedding (`no_rope_layers` in its config: 0 marks such a layer)."""

from __future__ import annotations

import dataclasses

from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.models.llama import LlamaForCausalLM, layer_description

__all__ = ["SmolLM3ForCausalLM"]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        desc = layer_description(config, layer_id)
        uses_rope = config.rope_layers is None or config.rope_layers[layer_id]
        return desc if uses_rope else dataclasses.replace(desc, rope="none")
