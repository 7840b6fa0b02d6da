"""The model registry (which class builds which checkpoint) and the layer description the
native decode step reads instead of a family's internals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sglang_like_kernels.cpu
from sglang_like.config import ModelConfig
from sglang_like.layers import native_decode
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.layers.quantization import QuantConfig
from sglang_like.models import registry
from sglang_like.models.llama import LlamaForCausalLM, layer_description

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)


@pytest.mark.parametrize(("cfg", "model_type"), [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "llama"),
    ({"model_type": "qwen3"}, "qwen3"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "qwen2"),  # no model_type: by architectures
    ({"architectures": ["MistralForCausalLM"]}, "mistral"),
])
def test_hf_configs_map_to_their_model_type(cfg: dict, model_type: str) -> None:
    assert registry.hf_model_type(cfg) == model_type
    assert registry.model_class(model_type) is LlamaForCausalLM


@pytest.mark.parametrize(("cfg", "model_type", "cls"), [
    ({"model_type": "gemma2"}, "gemma2", "GemmaForCausalLM"),
    ({"architectures": ["Gemma3ForCausalLM"]}, "gemma3_text", "GemmaForCausalLM"),
    ({"model_type": "phi3"}, "phi3", "Phi3ForCausalLM"),
    ({"model_type": "olmo2"}, "olmo2", "Olmo2ForCausalLM"),
    ({"model_type": "granite"}, "granite", "GraniteForCausalLM"),
    ({"model_type": "smollm3"}, "smollm3", "SmolLM3ForCausalLM"),
])
def test_family_files_build_their_model_types(cfg: dict, model_type: str, cls: str) -> None:
    assert registry.hf_model_type(cfg) == model_type
    built = registry.model_class(model_type)
    assert built.__name__ == cls and issubclass(built, LlamaForCausalLM)


@pytest.mark.parametrize("cfg", [
    {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
    {"architectures": ["PhiForCausalLM"]}, {"model_type": "deepseek_v3"}, {}])
def test_unsupported_hf_config_names_every_supported_type(cfg: dict) -> None:
    with pytest.raises(ValueError, match="unsupported") as err:
        registry.hf_model_type(cfg)
    for model_type, arch in [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")]:
        assert f"{model_type} ({arch})" in str(err.value)


def test_gguf_architectures() -> None:
    assert registry.family_for_gguf("qwen2").name == "llama"
    assert registry.family_for_gguf("gemma3").name == "gemma"
    with pytest.raises(ValueError, match="'phi2' unsupported; supported: llama, mistral"):
        registry.family_for_gguf("phi2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        registry.model_class("gpt2")


def test_every_family_class_is_importable_and_named_once() -> None:
    seen: set[str] = set()
    for family in registry.FAMILIES:
        assert len(family.model_types) == len(family.hf_architectures)
        for model_type in family.model_types:
            assert model_type not in seen
            seen.add(model_type)
            assert isinstance(registry.model_class(model_type), type)


@pytest.mark.parametrize(("change", "native"), [
    ({}, True),
    ({"qk_norm": "head"}, True),
    ({"qk_norm": "full"}, True),
    ({"activation": "gelu_tanh"}, True),
    ({"norm": "layer"}, False),  # LayerNorm: no kernel computes it
    ({"activation": "relu"}, False),
    ({"has_qkv_bias": True, "has_o_bias": True}, True),  # added after the per-op linears
    ({"sliding_window": 4096}, True),
    ({"attn_logit_softcap": 50.0}, True),
    ({"norm_layout": "sandwich"}, True),
    ({"norm_layout": "post"}, True),
    ({"rope": "none"}, True),
    ({"rope": "local"}, True),
    ({"residual_scale": 0.22}, True),
    ({"norm_eps": 1e-6}, True),
])
def test_native_step_supports_exactly_what_its_kernels_compute(change: dict, native: bool) -> None:
    assert native_decode.supports(dataclasses.replace(DecoderLayerDescription(), **change)) \
        is native


@pytest.mark.parametrize(("architecture", "change", "native"), [
    ("llama", {}, True),
    ("qwen2", {"attention_bias": True}, True),  # q/k/v biases: the per-op native path
    ("qwen3", {"qk_norm": True}, True),  # per-head q/k norms: in the native step too
])
def test_model_takes_the_native_step_by_its_description(architecture: str, change: dict,
                                                        native: bool) -> None:
    config = TINY.replace(architecture=architecture, **change)
    model = LlamaForCausalLM(config, QuantConfig("int8", torch.float32))
    desc = model.model.layers[0].description
    assert desc == layer_description(config)
    assert desc.has_o_bias is (architecture == "llama" and config.attention_bias)
    assert model.native_decode is (native and sglang_like_kernels.cpu.available())
    if not native:
        parts = [layer.parts() for layer in model.model.layers]
        with pytest.raises(ValueError, match="not what the native step computes"):
            native_decode.NativeDecodePlan(parts, torch.zeros(4, 8), torch.zeros(4, 8))
