"""An EAGLE-1/2 draft head in SGLang's on-disk layout (`LlamaForCausalLMEagle`).

The head the EAGLE and EAGLE-2 papers train (and SpecForge and the EAGLE repository ship for
Llama targets): one decoder layer over the target's last hidden state, read through the
target's own embedding and LM head:

    x      = fc(cat(embed(token), f))        (2H -> H, with a bias; f: the target's final
                                              hidden state after its norm, what its LM head
                                              reads; a later draft step feeds the head's own
                                              output instead)
    r      = x + o_proj(attention(q/k/v_proj(x)))        (no input norm on this layer)
    out    = r + mlp(post_attention_layernorm(r))
    logits = target_lm_head(out)                         (the full vocabulary)

`out` is what the next draft step takes as its feature. Positions as EAGLE-3's: the head's
K/V at position p come from the token at p + 1 and the feature at p (eagle.py).

A head folder holds config.json (a LlamaConfig with `architectures:
["LlamaForCausalLMEagle"]`, one hidden layer) and safetensors with `fc.weight`, `fc.bias`,
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, with or without a `model.` prefix; an
`embed_tokens.weight` or `lm_head.weight` in it is ignored (SGLang, too, gives the draft the
target's), and `layers.0.input_layernorm.weight` when present is unused (SGLang deletes it).
A reduced "hot" vocabulary (`hot_vocab_size` with a token map file) is not supported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang_like.model_loader.hf_loader import rope_settings
from sglang_like.speculative.eagle_head import _MLP, _RMSNorm, load_head_state, read_head_tensors

ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass
class Eagle1Config:
    """What config.json says (a LlamaConfig's keys)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size  # it reads the target's embedding and last hidden state

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Eagle1Config:
        archs = raw.get("architectures") or []
        if not archs or archs[0] != ARCHITECTURE:
            raise ValueError(f"not an EAGLE-1/2 head: architectures {archs}; expected "
                             f"[{ARCHITECTURE!r}]")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-1/2 heads are supported")
        hot = raw.get("hot_vocab_size")
        if hot and hot != raw["vocab_size"]:
            raise ValueError(f"an EAGLE-2 head with a reduced vocabulary (hot_vocab_size {hot})"
                             " needs SGLang's token map, which is not supported")
        theta, scaling = rope_settings(raw)
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            vocab_size=raw["vocab_size"], head_dim=raw.get("head_dim") or 0,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            attention_bias=bool(raw.get("attention_bias", False)))

    def to_json(self) -> dict[str, Any]:
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "hidden_act": "silu",
                "max_position_embeddings": self.max_position_embeddings,
                "attention_bias": self.attention_bias, "tie_word_embeddings": False,
                "torch_dtype": "float16"}


class _Attention(nn.Module):
    def __init__(self, c: Eagle1Config) -> None:
        super().__init__()
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, q_rows, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, kv_rows, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, kv_rows, bias=bias)
        self.o_proj = nn.Linear(q_rows, c.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: Eagle1Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)  # the same three projections as EAGLE-3's
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle1Head(nn.Module):
    """The head's weights and its math in the pieces the drafter runs (eagle.py), as
    `Eagle3Head`'s: `project`, `attention_inputs`, `finish`, `logits`, `to_target_ids`."""

    def __init__(self, config: Eagle1Config) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList([_Layer(config)])
        # the target's LM head (float32 [T, H] -> logits [T, vocab]), given by the drafter
        self.target_lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's last hidden state is already the head's width (in the head's
        dtype)."""
        return features.to(self.fc.weight.dtype)

    def attention_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D], k, v [T, Hkv, D] before RoPE, the layer's residual [T, H])."""
        c, attn = self.config, self.layers[0].self_attn
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeds.to(dtype), hidden.to(dtype)], dim=-1))
        t = x.shape[0]
        return (attn.q_proj(x).view(t, c.num_attention_heads, c.head_dim),
                attn.k_proj(x).view(t, c.num_key_value_heads, c.head_dim),
                attn.v_proj(x).view(t, c.num_key_value_heads, c.head_dim), x)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        r = residual + layer.self_attn.o_proj(attn_out)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.target_lm_head is None:
            raise RuntimeError("an EAGLE-1/2 head reads logits through the target's LM head")
        return self.target_lm_head(out).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def save(self, folder: str, dtype: torch.dtype = torch.float16) -> None:
        """SGLang's layout: the names without a `model.` prefix, as the EAGLE repository's."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        tensors = {k: v.to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config.to_json(), f, indent=2)


def load_eagle1_head(folder: str, raw_config: dict[str, Any],
                     device: torch.device | str = "cpu") -> Eagle1Head:
    """An EAGLE-1/2 head folder (see the module's docstring); weights become float32. A
    missing or mis-shaped tensor is a ValueError naming it."""
    head = Eagle1Head(Eagle1Config.from_json(raw_config))
    return load_head_state(head, read_head_tensors(folder), folder, device)
