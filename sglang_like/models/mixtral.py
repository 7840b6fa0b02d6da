"""Mixtral: the Llama decoder (Mistral's attention) with every MLP a mixture of experts whose
top-2 weights are renormalized. Its checkpoints name the sparse MLP `block_sparse_moe` and an
expert's matrices w1 (gate), w3 (up), w2 (down); they are renamed to the names layers/moe.py
loads. llama.cpp writes Mixtral as a "llama" GGUF with merged expert tensors, which the GGUF
loader maps to the same names."""

from __future__ import annotations

import re
from typing import Any

from sglang_like.config import ModelConfig
from sglang_like.models.llama import LlamaForCausalLM

__all__ = ["MixtralForCausalLM"]

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(experts\.\d+\.)?(\w+)\.weight$")
_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate": "gate"}


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_hf_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> None:
        for name in [n for n in weights if ".block_sparse_moe." in n]:
            m = _EXPERT.match(name)
            if m is None or m.group(3) not in _RENAMES:
                raise ValueError(f"unexpected Mixtral tensor {name!r}")
            layer, expert, part = m.groups()
            weights[f"{layer}.mlp.{expert or ''}{_RENAMES[part]}.weight"] = weights.pop(name)
