"""Load a GGUF file of any supported architecture (llama, mistral, qwen2, qwen3, gemma, gemma2,
gemma3, phi3, olmo2, granite, smollm3): config from metadata, weights with Hugging Face names.

The config is what llama.cpp's converter wrote plus what llama.cpp derives itself where the
file is silent (Gemma's scales, windows and soft-caps, SmolLM3's RoPE-less layers, ...), so that
a file converted from a Hugging Face folder loads as `hf_loader` loads that folder.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from sglang_like.config import ModelConfig
from sglang_like.model_loader.gguf_file import (
    GGUFTensor,
    iter_hf_tensors,
    read_float_tensor,
    read_gguf,
)
from sglang_like.model_loader.gguf_tokenizer import load_gguf_tokenizer, tokenizer_from_gguf
from sglang_like.model_loader.loaded import LoadedModel, check_weights
from sglang_like.models.phi3 import order_partial_rotary, split_fused
from sglang_like.models.registry import family_for_gguf
from sglang_like.tokenizer import Tokenizer

_GEMMA = ("gemma", "gemma2", "gemma3")
# llama.cpp's fixed sliding-window periods where the file lists no pattern (set_swa_pattern:
# layer i slides unless i % n == n - 1): Gemma 2 alternates, Gemma 3 has one global layer in
# six, OLMo 3 (olmo2 arch) one in four. Other architectures: every layer, as transformers does.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "olmo2": 4}
# Layer counts of the 27B Gemma 2 / 3, whose score scale llama.cpp takes from hidden / heads
# (their query_pre_attn_scalar) instead of head_dim; the converter does not write the scalar.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SMOLLM3_NO_ROPE_EVERY = 4  # llama.cpp hard-codes SmolLM3's RoPE-less layers: every 4th


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv) must be uniform here
        if len(set(value)) != 1:
            raise ValueError(f"GGUF field {key} varies per layer ({value}); not supported")
        value = value[0]
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return value


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: the value config.json
    had (0.1, not 0.10000000149), so that scales and epsilons equal a folder's."""
    return float(str(np.float32(value)))


def _float(metadata: dict[str, Any], key: str, default: float | None = None) -> float | None:
    value = metadata.get(key)
    return default if value is None else _f32(value)


def _rope_scaling(metadata: dict[str, Any], arch: str, tensors: list[GGUFTensor],
                  context: int) -> dict[str, Any] | None:
    """The rope scaling in transformers' terms, which rotary.py reads. llama.cpp keeps Llama 3's
    as per-frequency divisors (rope_freqs) and Phi-3's longrope factors as tensors: both are
    read from there."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    orig = metadata.get(f"{arch}.rope.scaling.original_context_length")
    long = read_float_tensor(tensors, "rope_factors_long.weight")
    short = read_float_tensor(tensors, "rope_factors_short.weight")
    # Phi-3's converter writes no scaling type: llama.cpp applies the factors wherever the
    # file has them (the long ones past the original context)
    if kind == "longrope" or long is not None:
        if long is None or short is None:
            raise ValueError("GGUF longrope needs both rope_factors_long and rope_factors_short")
        if orig is None:
            raise ValueError(f"GGUF longrope factors without {arch}.rope.scaling."
                             "original_context_length")
        scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": short,
                                   "long_factor": long,
                                   "original_max_position_embeddings": int(orig)}
        attn = metadata.get(f"{arch}.rope.scaling.attn_factor")
        factor = context / int(orig)
        default = math.sqrt(1 + math.log(factor) / math.log(int(orig))) if factor > 1 else 1.0
        # the converter writes transformers' default; kept only where the file says otherwise,
        # so that the default is computed in float64 as for a folder
        if attn is not None and np.float32(attn) != np.float32(default):
            scaling["attention_factor"] = float(attn)
        return scaling
    freqs = read_float_tensor(tensors, "rope_freqs.weight")
    if freqs is not None and kind in (None, "none"):
        # Llama 3's scaling as the converter stores it (no scaling type, a rope_freqs tensor):
        # one divisor per frequency, which is what longrope applies with the same factors at
        # every length and scores unscaled
        return {"rope_type": "longrope", "short_factor": freqs, "long_factor": freqs,
                "original_max_position_embeddings": context, "attention_factor": 1.0}
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind}
    if (factor := metadata.get(f"{arch}.rope.scaling.factor")) is not None:
        scaling["factor"] = _f32(factor)
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    if kind == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if (value := metadata.get(f"{arch}.rope.scaling.{key}")) is not None:
                scaling[name] = _f32(value)
    return scaling


def _layer_types(metadata: dict[str, Any], arch: str, num_layers: int
                 ) -> tuple[tuple[str, ...] | None, int | None]:
    """(each layer's attention kind or None when all are full, the window) as llama.cpp reads
    them: `attention.sliding_window` (Gemma 2 defaults to 4096 without it) and the layers from
    `attention.sliding_window_pattern` (flags per layer, or a period) or the arch's period."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is None and arch == "gemma2":
        window = 4096
    if not window:
        return None, None
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern lists {len(pattern)} "
                             f"layers, the model has {num_layers}")
        sliding = [bool(v) for v in pattern]
    else:
        n = int(pattern) if pattern is not None else _SWA_PERIOD.get(arch, 0)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    if not any(sliding):
        return None, None
    kinds = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    return kinds, int(window)


def _family_fields(metadata: dict[str, Any], arch: str, *, hidden: int, num_heads: int,
                   head_dim: int, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields in which a family differs from Llama (hf_loader's
    `_family_fields` from config.json; here from the metadata and llama.cpp's own rules)."""
    fields: dict[str, Any] = {}
    if arch in _GEMMA:
        fields["hidden_act"] = "gelu_tanh"
        fields["embedding_scale"] = hidden**0.5
    if arch in ("gemma2", "gemma3"):
        big = num_layers == _GEMMA_27B_LAYERS[arch]
        fields["attention_scale"] = float(hidden // num_heads if big else head_dim) ** -0.5
    if arch == "gemma2":  # llama.cpp soft-caps Gemma 2 always, 50 / 30 unless the file says
        fields["attn_logit_softcap"] = _float(metadata, "gemma2.attn_logit_softcapping", 50.0)
        fields["final_logit_softcap"] = _float(metadata, "gemma2.final_logit_softcapping", 30.0)
    elif arch == "gemma3":
        fields["final_logit_softcap"] = _float(metadata, "gemma3.final_logit_softcapping") or None
        fields["rope_local_theta"] = _float(metadata, "gemma3.rope.freq_base_swa", 10000.0)
    if arch == "granite":
        fields["embedding_scale"] = _float(metadata, "granite.embedding_scale", 1.0)
        fields["residual_scale"] = _float(metadata, "granite.residual_scale", 1.0)
        fields["attention_scale"] = _float(metadata, "granite.attention.scale") or head_dim**-0.5
        fields["logit_scale"] = 1.0 / _float(metadata, "granite.logit_scale", 1.0)
    if arch == "smollm3":
        fields["rope_layers"] = tuple((i + 1) % _SMOLLM3_NO_ROPE_EVERY != 0
                                      for i in range(num_layers))
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        fields["rotary_dim"] = int(rotary)
    return fields


# llama.cpp's graphs renormalize the chosen experts' weights for these architectures ("llama"
# is Mixtral), whatever the file says; others read `{arch}.expert_weights_norm` (default off)
_MOE_RENORMALIZED = frozenset({"llama", "qwen3moe"})


def _moe_fields(metadata: dict[str, Any], arch: str, tensor_shapes: dict[str, tuple[int, ...]],
                num_layers: int) -> dict[str, Any]:
    """A mixture of experts' ModelConfig fields; a layer is sparse where it has a router."""
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes for i in range(num_layers))
    inter = metadata.get(f"{arch}.expert_feed_forward_length")
    if inter is None:  # Mixtral's experts are its feed_forward_length wide
        inter = _scalar(metadata, f"{arch}.feed_forward_length")
    norm = metadata.get(f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(_scalar(metadata, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(inter),
        "norm_topk_prob": arch in _MOE_RENORMALIZED or bool(norm),
        "shared_expert_intermediate_size": int(
            metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
        "moe_layers": None if all(sparse) else sparse,
    }


def gguf_model_config(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], tokenizer: Tokenizer,
    model_path: str, tensors: list[GGUFTensor] | None = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata; tensor_shapes ([out, in] order) decide ties, biases and
    q/k norms; `tensors` (the file's) give the RoPE factors llama.cpp stores as tensors."""
    arch = metadata.get("general.architecture")
    family_for_gguf(arch)  # a ValueError listing the supported architectures
    num_heads = int(_scalar(metadata, f"{arch}.attention.head_count"))
    hidden = int(_scalar(metadata, f"{arch}.embedding_length"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // num_heads)
    num_layers = int(_scalar(metadata, f"{arch}.block_count"))
    context = int(_scalar(metadata, f"{arch}.context_length", 2048))
    layer_types, window = _layer_types(metadata, arch, num_layers)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(_scalar(metadata, f"{arch}.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(_scalar(metadata, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(_scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(_scalar(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch, tensors or [], context),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias=("blk.0.attn_q.bias" in tensor_shapes
                        or "blk.0.attn_qkv.bias" in tensor_shapes),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        model_path=model_path,
        layer_types=layer_types,
        sliding_window=window,
        **_family_fields(metadata, arch, hidden=hidden, num_heads=num_heads, head_dim=head_dim,
                         num_layers=num_layers),
        **_moe_fields(metadata, arch, tensor_shapes, num_layers),
    )


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              keep_packed: bool = False) -> LoadedModel:
    """Read `path`, dequantize tensors to `dtype` (or, with `keep_packed`, keep block-type
    matrices as their blocks), un-permute Q/K where the converter permuted them, split fused
    q/k/v and gate/up (Phi-3), build the tokenizer. Gemma's norms are used as stored: the
    converter has folded the 1 + w in already."""
    file = read_gguf(path)
    metadata = file.metadata
    family_for_gguf(metadata.get("general.architecture"))  # refused by name before anything
    tokenizer = tokenizer_from_gguf(metadata)
    shapes = {t.name: t.shape for t in file.tensors}
    config = gguf_model_config(metadata, shapes, tokenizer, path, file.tensors)
    weights = dict(
        iter_hf_tensors(
            file.tensors, arch=config.architecture, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, dtype=dtype, keep_packed=keep_packed,
        )
    )
    for i in range(config.num_hidden_layers):
        split_fused(config, weights, f"model.layers.{i}.")  # a no-op without fused tensors
    # partial rotary: llama.cpp rotates each head's leading dims in halves as transformers
    # does, so the rows take the order the HF loader gives them (a no-op for a full rotation)
    order_partial_rotary(config, weights)
    check_weights(config, weights)
    return LoadedModel(config, weights, tokenizer)


__all__ = ["gguf_model_config", "load_gguf", "load_gguf_tokenizer"]
