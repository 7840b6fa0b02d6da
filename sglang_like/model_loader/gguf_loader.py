"""Load a GGUF file (llama / mistral / qwen2 / qwen3): config from metadata, dequantized weights."""

from __future__ import annotations

from typing import Any

import torch

from sglang_like.config import ModelConfig
from sglang_like.model_loader.gguf_file import iter_hf_tensors, read_gguf
from sglang_like.model_loader.gguf_tokenizer import load_gguf_tokenizer, tokenizer_from_gguf
from sglang_like.model_loader.loaded import LoadedModel, check_weights
from sglang_like.models.registry import family_for_gguf
from sglang_like.tokenizer import Tokenizer


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv) must be uniform here
        if len(set(value)) != 1:
            raise ValueError(f"GGUF field {key} varies per layer ({value}); not supported")
        value = value[0]
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return value


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if (factor := metadata.get(f"{arch}.rope.scaling.factor")) is not None:
        scaling["factor"] = float(factor)
    if (orig := metadata.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def gguf_model_config(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], tokenizer: Tokenizer,
    model_path: str,
) -> ModelConfig:
    """ModelConfig from GGUF metadata; tensor_shapes ([out, in] order) decide ties and biases."""
    arch = metadata.get("general.architecture")
    family_for_gguf(arch)  # a ValueError listing the supported architectures
    num_heads = int(_scalar(metadata, f"{arch}.attention.head_count"))
    hidden = int(_scalar(metadata, f"{arch}.embedding_length"))
    head_dim = metadata.get(f"{arch}.attention.key_length") or hidden // num_heads
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(_scalar(metadata, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_scalar(metadata, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_scalar(metadata, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_scalar(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_position_embeddings=int(_scalar(metadata, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        model_path=model_path,
    )


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              keep_packed: bool = False) -> LoadedModel:
    """Read `path`, dequantize tensors to `dtype` (or, with `keep_packed`, keep block-type
    matrices as their blocks), un-permute llama Q/K, build the tokenizer."""
    file = read_gguf(path)
    metadata = file.metadata
    tokenizer = tokenizer_from_gguf(metadata)
    shapes = {t.name: t.shape for t in file.tensors}
    config = gguf_model_config(metadata, shapes, tokenizer, path)
    weights = dict(
        iter_hf_tensors(
            file.tensors, arch=config.architecture, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, dtype=dtype, keep_packed=keep_packed,
        )
    )
    check_weights(config, weights)
    return LoadedModel(config, weights, tokenizer)


__all__ = ["gguf_model_config", "load_gguf", "load_gguf_tokenizer"]
