"""Multi-LoRA serving: PEFT adapters read and fitted to the model (`adapter`), and the
engine's set of loaded adapters (`registry`). The per-row deltas are computed in
`sglang_like.layers.lora`."""

import os

from sglang_like.lora.adapter import (
    LORA_TARGETS,
    LoraAdapter,
    LoraAdapterError,
    parse_lora_paths,
    read_adapter,
)
from sglang_like.lora.registry import LoadedAdapter, LoraRegistry, LoraSharding

SHIPPED_ADAPTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters",
                               "smollm2-135m-json-answer")
"""The adapter trained here for the default model (answers as one-line JSON; its README)."""

__all__ = ["LORA_TARGETS", "SHIPPED_ADAPTER", "LoadedAdapter", "LoraAdapter", "LoraAdapterError",
           "LoraRegistry", "LoraSharding", "parse_lora_paths", "read_adapter"]
