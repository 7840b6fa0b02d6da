"""Which class builds which checkpoint: Hugging Face architectures / model_type and GGUF
`general.architecture` names mapped to a model family. Torch-free: classes are imported only
when a model is built."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    """One model file's reach: the checkpoints its class builds."""

    name: str
    model_class: str  # "module:Class"
    model_types: tuple[str, ...]  # config.json "model_type" values
    hf_architectures: tuple[str, ...]  # config.json "architectures" values
    gguf_architectures: tuple[str, ...]  # GGUF "general.architecture" values


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="llama",
        model_class="sglang_like.models.llama:LlamaForCausalLM",
        model_types=("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"),
        hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                          "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                          "MixtralForCausalLM"),
        # a "llama" file with expert tensors is Mixtral (llama.cpp writes it so)
        gguf_architectures=("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe"),
    ),
    ModelFamily(
        name="olmoe",
        model_class="sglang_like.models.olmoe:OlmoeForCausalLM",
        model_types=("olmoe",),
        hf_architectures=("OlmoeForCausalLM",),
        gguf_architectures=("olmoe",),
    ),
    ModelFamily(
        name="gemma",
        model_class="sglang_like.models.gemma:GemmaForCausalLM",
        model_types=("gemma", "gemma2", "gemma3_text"),
        hf_architectures=("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
        gguf_architectures=("gemma", "gemma2", "gemma3"),
    ),
    ModelFamily(
        name="phi3",
        model_class="sglang_like.models.phi3:Phi3ForCausalLM",
        model_types=("phi3",),
        hf_architectures=("Phi3ForCausalLM",),
        gguf_architectures=("phi3",),
    ),
    ModelFamily(
        name="olmo2",
        model_class="sglang_like.models.olmo2:Olmo2ForCausalLM",
        model_types=("olmo2",),
        hf_architectures=("Olmo2ForCausalLM",),
        gguf_architectures=("olmo2",),
    ),
    ModelFamily(
        name="granite",
        model_class="sglang_like.models.granite:GraniteForCausalLM",
        model_types=("granite",),
        hf_architectures=("GraniteForCausalLM",),
        gguf_architectures=("granite",),
    ),
    ModelFamily(
        name="smollm3",
        model_class="sglang_like.models.smollm3:SmolLM3ForCausalLM",
        model_types=("smollm3",),
        hf_architectures=("SmolLM3ForCausalLM",),
        gguf_architectures=("smollm3",),
    ),
)

# vision-language checkpoints (config.json model_type -> the image side's family): their
# text_config is a text family above; the image side is the family's module in models/
VISION_MODEL_TYPES = {"llava": "llava", "idefics3": "idefics3", "smolvlm": "idefics3",
                      "gemma3": "gemma3"}
VISION_CLASSES = {"llava": "sglang_like.models.llava:LlavaVision",
                  "idefics3": "sglang_like.models.idefics3:Idefics3Vision",
                  "gemma3": "sglang_like.models.gemma3_vision:Gemma3Vision"}


def vision_class(family: str) -> type:
    """The module class of a vision family's image side (encoder + projector)."""
    module, _, name = VISION_CLASSES[family].partition(":")
    return getattr(importlib.import_module(module), name)


SUPPORTED_GGUF_ARCHS = tuple(a for f in FAMILIES for a in f.gguf_architectures)


def _supported() -> str:
    return "; ".join(f"{t} ({a})" for f in FAMILIES
                     for t, a in zip(f.model_types, f.hf_architectures, strict=True))


def hf_model_type(cfg: dict[str, Any]) -> str:
    """The supported model_type of a config.json: its own, or where it has none, the one its
    architectures name; a ValueError naming every supported model type otherwise."""
    model_type = cfg.get("model_type")
    archs = list(cfg.get("architectures") or [])
    for family in FAMILIES:
        if model_type in family.model_types:
            return model_type
        for t, a in zip(family.model_types, family.hf_architectures, strict=True):
            if model_type is None and a in archs:
                return t
    raise ValueError(f"model_type {model_type!r} (architectures {archs}) unsupported; "
                     f"supported: {_supported()}")


def family_for_gguf(arch: str | None) -> ModelFamily:
    """The family of a GGUF file's `general.architecture`; a ValueError listing the
    supported ones otherwise."""
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family
    raise ValueError(f"GGUF architecture {arch!r} unsupported; supported: "
                     f"{', '.join(SUPPORTED_GGUF_ARCHS)}")


def family_for(architecture: str) -> ModelFamily:
    """The family of a `ModelConfig.architecture` (a model_type or GGUF architecture)."""
    for family in FAMILIES:
        if architecture in family.model_types or architecture in family.gguf_architectures:
            return family
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {_supported()}")


def model_class(architecture: str) -> type:
    """The class that builds a model of this `ModelConfig.architecture`."""
    module, _, name = family_for(architecture).model_class.partition(":")
    return getattr(importlib.import_module(module), name)
