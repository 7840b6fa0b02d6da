"""Multi-LoRA serving: PEFT adapters read and fitted to the model (`adapter`), and the
engine's set of loaded adapters (`registry`). The per-row deltas are computed in
`sglang_like.layers.lora`."""

from sglang_like.lora.adapter import (
    LORA_TARGETS,
    LoraAdapter,
    LoraAdapterError,
    parse_lora_paths,
    read_adapter,
)
from sglang_like.lora.registry import LoadedAdapter, LoraRegistry

__all__ = ["LORA_TARGETS", "LoadedAdapter", "LoraAdapter", "LoraAdapterError", "LoraRegistry",
           "parse_lora_paths", "read_adapter"]
