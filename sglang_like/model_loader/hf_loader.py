"""Load a Hugging Face checkpoint folder (config.json + safetensors) of the supported families."""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from safetensors.torch import load_file

from sglang_like.config import ModelConfig, VisionConfig
from sglang_like.model_loader.hf_tokenizer import load_hf_tokenizer, read_json
from sglang_like.model_loader.loaded import LoadedModel, check_weights
from sglang_like.models.registry import VISION_MODEL_TYPES, hf_model_type, model_class


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) of a Hugging Face config.json (of its global layers,
    where a config gives each layer type its own)."""
    # transformers >= 5 writes rope settings under "rope_parameters" (per layer type for
    # Gemma 3); older versions flat
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling and "original_max_position_embeddings" in cfg:  # Phi-3 keeps it at the top
        scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"],
                   **scaling}
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def _local_rope_theta(cfg: dict[str, Any]) -> float | None:
    """Gemma 3's sliding layers' RoPE base (unscaled)."""
    params = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if params is not None:
        return float(params.get("rope_theta", 10000.0))
    base = cfg.get("rope_local_base_freq")
    return None if base is None else float(base)


_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _layer_types(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...] | None:
    """Each layer's attention kind ("full_attention" / "sliding_attention") as transformers
    computes it; None where every layer is full."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if model_type in _QWEN and not cfg.get("use_sliding_window"):
        return None  # Qwen configs carry a window they only use behind this flag
    kinds = cfg.get("layer_types")
    if kinds is None:  # configs written before transformers listed each layer's kind
        full, sliding = "full_attention", "sliding_attention"
        if model_type == "gemma2":  # even layers slide
            kinds = [sliding if i % 2 == 0 else full for i in range(num_layers)]
        elif model_type == "gemma3_text":  # every `pattern`-th layer is global
            pattern = int(cfg.get("sliding_window_pattern", 6))
            kinds = [full if (i + 1) % pattern == 0 else sliding for i in range(num_layers)]
        elif model_type in _QWEN:  # the layers from max_window_layers slide
            first = int(cfg.get("max_window_layers", num_layers))
            kinds = [sliding if i >= first else full for i in range(num_layers)]
        else:  # Mistral: every layer
            kinds = [sliding] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    return tuple(kinds) if "sliding_attention" in kinds else None


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _activation(cfg: dict[str, Any], model_type: str) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if model_type.startswith("gemma") and name == "gelu":
        name = "gelu_pytorch_tanh"  # Gemma's released configs say "gelu" for the tanh form
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} unsupported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _moe_fields(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """A mixture of experts' ModelConfig fields (none for a dense model)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    if cfg.get("clip_qkv"):  # OLMoE's option; its released models leave it off
        raise ValueError(f"clip_qkv={cfg['clip_qkv']} is not supported")
    # Qwen-MoE: a layer is sparse unless listed dense or off the sparse step
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size")
                                     or cfg["intermediate_size"]),
        # Mixtral renormalizes its top-2 always (its config has no flag)
        "norm_topk_prob": model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size")
                                               or 0),
        "moe_layers": None if all(sparse) else sparse,
    }


def _family_fields(cfg: dict[str, Any], model_type: str, hidden: int, head_dim: int,
                   num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields in which a family differs from Llama."""
    fields: dict[str, Any] = _moe_fields(cfg, model_type, num_layers)
    if model_type.startswith("gemma"):
        fields["embedding_scale"] = hidden**0.5
        if model_type != "gemma":
            fields["attention_scale"] = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
        if model_type == "gemma3_text":
            fields["rope_local_theta"] = _local_rope_theta(cfg) or 10000.0
    if model_type == "granite":
        fields["embedding_scale"] = float(cfg.get("embedding_multiplier", 1.0))
        fields["residual_scale"] = float(cfg.get("residual_multiplier", 1.0))
        fields["attention_scale"] = float(cfg.get("attention_multiplier", head_dim**-0.5))
        fields["logit_scale"] = 1.0 / float(cfg.get("logits_scaling", 1.0))
    if model_type == "smollm3" and cfg.get("no_rope_layers") is not None:
        fields["rope_layers"] = tuple(bool(v) for v in cfg["no_rope_layers"])
    for key, field_name in (("attn_logit_softcapping", "attn_logit_softcap"),
                            ("final_logit_softcapping", "final_logit_softcap")):
        if cfg.get(key):
            fields[field_name] = float(cfg[key])
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        fields["rotary_dim"] = int(head_dim * factor)
    return fields


def hf_model_config(
    cfg: dict[str, Any], *, has_lm_head: bool, eos_token_ids: tuple[int, ...], model_path: str
) -> ModelConfig:
    """ModelConfig from a config.json dict; a missing tie flag is read off the checkpoint."""
    model_type = hf_model_type(cfg)  # a ValueError naming the supported ones
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    theta, scaling = rope_settings(cfg)
    bos = cfg.get("bos_token_id")
    layer_types = _layer_types(cfg, model_type, num_layers)
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", not has_lm_head)),
        attention_bias=(model_type == "qwen2" or bool(cfg.get("attention_bias", False))
                        or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
        qk_norm=model_type in ("qwen3", "gemma3_text", "olmo2", "qwen3_moe", "olmoe"),
        bos_token_id=None if isinstance(bos, list) or bos is None else int(bos),
        eos_token_ids=eos_token_ids,
        model_path=model_path,
        hidden_act=_activation(cfg, model_type),
        layer_types=layer_types,
        sliding_window=int(cfg["sliding_window"]) if layer_types else None,
        **_family_fields(cfg, model_type, hidden, head_dim, num_layers),
    )


def _safetensors_files(path: str) -> list[str]:
    index = read_json(os.path.join(path, "model.safetensors.index.json"))
    if index:
        return sorted({os.path.join(path, f) for f in index["weight_map"].values()})
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    return files


# a multimodal checkpoint's language model, under the names its text-only sibling uses
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("model.text_model.", "model."))
# its image side (VISION_MODEL_TYPES), kept as "vision." + the name inside the family's module
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "vision_model.", "connector.")


def load_safetensors(path: str, dtype: torch.dtype, vision: bool = False
                     ) -> dict[str, torch.Tensor]:
    """All model.* / lm_head.* tensors of the folder's (possibly sharded) safetensors, as dtype
    (a multimodal checkpoint's language model renamed so). Its image side is left out, or with
    `vision` kept under "vision." (`_vision_name`)."""
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        for name, tensor in load_file(file).items():
            inner = _vision_name(name) if vision else None
            if inner is not None:
                weights["vision." + inner] = tensor.to(dtype)
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.startswith(("model.", "lm_head.")) and "rotary_emb" not in name:
                weights[name] = tensor.to(dtype)
    return weights


def _vision_name(name: str) -> str | None:
    """A vision weight's name inside its family module, whichever layout saved it (LLaVA's
    tower with or without "vision_model.", under "model." or not); None for a text weight."""
    if name.startswith("model.") and name[6:].startswith(_VISION_PARTS):
        name = name[6:]
    if not name.startswith(_VISION_PARTS):
        return None
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the model that reads and writes text: the file's own, or a multimodal
    checkpoint's `text_config` (Gemma 3 4B and up ship as Gemma3ForConditionalGeneration;
    LLaVA and Idefics3 / SmolVLM wrap a text model of the registry)."""
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True),
                **cfg["text_config"]}
        return text | {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    if cfg.get("model_type") in VISION_MODEL_TYPES:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "llama")
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return text
    return cfg


def vision_config(cfg: dict[str, Any]) -> VisionConfig | None:
    """The image side of a LLaVA or Idefics3 / SmolVLM config.json; None for a text model."""
    family = VISION_MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        return None
    v = cfg.get("vision_config") or {}
    encoder = "clip" if v.get("model_type", "clip_vision_model") == "clip_vision_model" else (
        "siglip")
    if family in ("idefics3", "gemma3"):
        encoder = "siglip"
    if family == "gemma3" and not v:
        return None  # Gemma3ForConditionalGeneration without a vision tower: text only
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if image_token is None:
        raise ValueError("the vision-language config names no image_token_id")
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only one feature layer is supported")
    hidden = int(v.get("hidden_size", 768))
    return VisionConfig(
        family=family, encoder=encoder, hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 4 * hidden)),
        num_hidden_layers=int(v.get("num_hidden_layers", 12)),
        num_attention_heads=int(v.get("num_attention_heads", 12)),
        image_size=int(v.get("image_size", 224)), patch_size=int(v.get("patch_size", 32)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5 if encoder == "clip" else 1e-6)),
        hidden_act=v.get("hidden_act", "quick_gelu" if encoder == "clip"
                         else "gelu_pytorch_tanh"),
        image_token_id=int(image_token), feature_layer=int(layer),
        feature_select=cfg.get("vision_feature_select_strategy", "default"),
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        scale_factor=int(cfg.get("scale_factor", 1)),
        tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)) if family == "gemma3" else 0,
        bidirectional=family == "gemma3")


def load_hf_folder(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Config, weights and tokenizer of a local HF checkpoint folder."""
    full_cfg = read_json(os.path.join(path, "config.json"))
    if not full_cfg:
        raise ValueError(f"no config.json in {path!r}")
    cfg = text_config(full_cfg)
    vision = vision_config(full_cfg)
    tokenizer = load_hf_tokenizer(path)
    weights = load_safetensors(path, dtype, vision=vision is not None)
    config = hf_model_config(
        cfg, has_lm_head="lm_head.weight" in weights,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)), model_path=path,
    ).replace(vision=vision)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the runner reuses embed_tokens
    # the text family's renames and folds (Gemma's 1 + w norms) are not the vision side's
    image_side = {n: weights.pop(n) for n in [n for n in weights if n.startswith("vision.")]}
    model_class(config.architecture).adapt_hf_weights(config, weights)
    check_weights(config, weights)
    return LoadedModel(config, weights | image_side, tokenizer)
