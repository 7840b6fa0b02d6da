"""Load a Hugging Face checkpoint folder (config.json + safetensors) of the supported families."""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import torch
from safetensors.torch import load_file

from sglang_like.config import ModelConfig
from sglang_like.model_loader.hf_tokenizer import load_hf_tokenizer, read_json
from sglang_like.model_loader.loaded import LoadedModel, check_weights
from sglang_like.models.registry import hf_model_type

logger = logging.getLogger(__name__)



def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) of a Hugging Face config.json."""
    # transformers >= 5 writes rope settings under "rope_parameters"; older versions flat.
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window some layer uses, or None when every layer sees its whole context."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # transformers >= 4.53 lists each layer's kind
        return int(window) if "sliding_attention" in layer_types else None
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        return None  # Qwen configs carry a window they only use behind this flag
    return int(window)


def _max_positions(cfg: dict[str, Any]) -> int:
    # Our attention has no sliding window: stop the context at the window, where it still
    # equals the model's (Mistral v0.1: 4096 of 32768), rather than go on silently wrong.
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    window = _sliding_window(cfg)
    if window is not None and window < max_positions:
        logger.warning("sliding window %d: context limited to %d (of %d)", window, window,
                       max_positions)
        return window
    return max_positions


def hf_model_config(
    cfg: dict[str, Any], *, has_lm_head: bool, eos_token_ids: tuple[int, ...], model_path: str
) -> ModelConfig:
    """ModelConfig from a config.json dict; a missing tie flag is read off the checkpoint."""
    model_type = hf_model_type(cfg)  # a ValueError naming the supported ones
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = rope_settings(cfg)
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_max_positions(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", not has_lm_head)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        bos_token_id=None if isinstance(bos, list) or bos is None else int(bos),
        eos_token_ids=eos_token_ids,
        model_path=model_path,
    )


def _safetensors_files(path: str) -> list[str]:
    index = read_json(os.path.join(path, "model.safetensors.index.json"))
    if index:
        return sorted({os.path.join(path, f) for f in index["weight_map"].values()})
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    return files


def load_safetensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All model.* / lm_head.* tensors of the folder's (possibly sharded) safetensors, as dtype."""
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        for name, tensor in load_file(file).items():
            if name.startswith(("model.", "lm_head.")):
                weights[name] = tensor.to(dtype)
    return weights


def load_hf_folder(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Config, weights and tokenizer of a local HF checkpoint folder."""
    cfg = read_json(os.path.join(path, "config.json"))
    if not cfg:
        raise ValueError(f"no config.json in {path!r}")
    tokenizer = load_hf_tokenizer(path)
    weights = load_safetensors(path, dtype)
    config = hf_model_config(
        cfg, has_lm_head="lm_head.weight" in weights,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)), model_path=path,
    )
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the runner reuses embed_tokens
    check_weights(config, weights)
    return LoadedModel(config, weights, tokenizer)
