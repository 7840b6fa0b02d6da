"""An EAGLE-3 draft head in SGLang's on-disk layout (`LlamaForCausalLMEagle3`).

One decoder layer predicts the target's next token from the target's own features:

    g      = fc(cat(h_low, h_mid, h_high))          (3H -> H; a later draft step feeds
                                                      the head's own output instead)
    x      = cat(input_layernorm(embed(token)), hidden_norm(g))    (2H wide)
    r      = g + o_proj(attention(q/k/v_proj(x)))
    out    = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out))                      (over a reduced draft vocabulary;
                                                      draft id d is target id d + d2t[d])

`out` (before the norm) is what the next draft step takes as its feature. The embedding is
the target's (SGLang shares it too), so a head folder holds: config.json and
model.safetensors with `fc.weight`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
Checkpoints SpecForge writes for other Llama/Qwen targets have the same names.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_like.model_loader.hf_loader import rope_settings

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """What config.json says (the keys SGLang and SpecForge read)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rope_scaling: dict[str, Any] | None = None  # as the target's (e.g. Llama 3.1's "llama3")
    # target layers whose input (the residual stream entering them) is fed; [] = the default
    aux_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Eagle3Config:
        archs = raw.get("architectures") or [ARCHITECTURE]
        if archs[0] != ARCHITECTURE:
            raise ValueError(f"not an EAGLE-3 head: architectures {archs}; expected "
                             f"[{ARCHITECTURE!r}]")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 heads are supported")
        eagle = raw.get("eagle_config") or {}
        refuse_variants(raw, eagle)
        theta, scaling = rope_settings(raw)
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            head_dim=raw.get("head_dim") or 0, rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            aux_layer_ids=capture_layer_ids(eagle.get("eagle_aux_hidden_state_layer_ids") or []),
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        aux = d.pop("aux_layer_ids")
        d |= {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float16"}
        if aux:
            if aux[0] == 1:
                raise ValueError("aux layer ids starting at layer 1's input cannot be written: "
                                 "a first id of 1 is read as the first layer's output")
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        return d


# config.json switches of SGLang's `LlamaForCausalLMEagle3` for head variants this runtime
# does not run: loaded without them, such a head would draft from other inputs than it was
# trained on, silently (a bias on fc, an RMSNorm over the concatenated features or over each
# of them before fc, the normed output as the next step's feature)
_VARIANTS = ("bias", "norm_before_fc", "fc_norm", "use_aux_norm", "norm_output")


def refuse_variants(raw: dict[str, Any], eagle: dict[str, Any]) -> None:
    """A ValueError naming the first switch of `_VARIANTS` a head's config turns on, or a
    feature count other than three."""
    for key in _VARIANTS:
        if eagle.get(key, raw.get(key)):
            raise ValueError(f"EAGLE-3 head variant {key!r} is not supported (the head would "
                             "run without it and draft from other inputs than it learned)")
    count = raw.get("num_aux_hidden_states")
    if count is not None and count != 3:
        raise ValueError(f"EAGLE-3 heads over {count} target features are not supported "
                         "(three: low, middle, high)")


def capture_layer_ids(ids: list[int]) -> list[int]:
    """config.json's `eagle_aux_hidden_state_layer_ids` as the target layers whose input is
    captured. Heads ship two conventions, told apart by the first id as SGLang's loader does:
    "the output of layer X" starts at 1 (the first block's output; the embedding is never a
    feature) and means the input of layer X + 1, e.g. [1, 15, 28] for a 32-layer target;
    "the input of layer X" (SGLang's default [2, L/2, L-3], vLLM's reading, ours) starts
    anywhere else. Read the first way with no offset, a head gets the features of the
    layer below the ones it was trained on."""
    ids = [int(i) for i in ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 sums whatever the head's dtype; the result in its dtype
        w = self.weight
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(w.dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, q_rows, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv_rows, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv_rows, bias=False)
        self.o_proj = nn.Linear(q_rows, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """The head's weights and its math in pieces, shared by inference (attention over the
    draft KV pool, `sglang_like.speculative.eagle`) and training (dense attention with the
    training-time-test unroll, `training.train_eagle`)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    # ---- the math, in the order a forward runs it ---------------------------------------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3H_target] -> [T, H]; the head's own outputs pass through (in
        the head's dtype)."""
        if features.shape[-1] == self.config.hidden_size:
            return features.to(self.fc.weight.dtype)
        return self.fc(features.to(self.fc.weight.dtype))

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) before RoPE."""
        c, layer = self.config, self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        attn = layer.self_attn
        t = x.shape[0]
        return (attn.q_proj(x).view(t, c.num_attention_heads, c.head_dim),
                attn.k_proj(x).view(t, c.num_key_value_heads, c.head_dim),
                attn.v_proj(x).view(t, c.num_key_value_heads, c.head_dim))

    def attention_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv` and the layer's residual (its input feature), as `Eagle1Head`'s."""
        return (*self.qkv(embeds, hidden), hidden)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention output [T, Hq*D] and the layer's input feature -> `out` [T, H] (pre-norm:
        the next draft step's feature)."""
        layer = self.midlayer
        r = hidden + layer.self_attn.o_proj(attn_out)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H] -> draft-vocabulary logits [T, draft_vocab] float32."""
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def drop_float_weights(self) -> None:
        """Free the float32 weights once another copy owns the math (the CPU fast path packs
        them, `NativeEagleHead`): 37 MB for the default head. The config and the vocabulary
        maps stay; the math above then raises."""
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(param.new_empty(0), requires_grad=False))

    # ---- files ---------------------------------------------------------------------------
    def save(self, folder: str, dtype: torch.dtype = torch.float16) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config.to_json(), f, indent=2)


def read_head_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a head folder's *.safetensors, under SpecForge / SGLang spellings: an
    optional "model." prefix dropped."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors |= load_file(os.path.join(folder, name))
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def load_head_state(head: nn.Module, tensors: dict[str, torch.Tensor], folder: str,
                    device: torch.device | str) -> nn.Module:
    """`head` with every tensor of its state taken from `tensors` (in its own dtype; others
    ignored), in eval mode on `device`. A missing or mis-shaped tensor is a ValueError naming
    it."""
    state = head.state_dict()
    missing = sorted(set(state) - set(tensors))
    if missing:
        raise ValueError(f"draft head {folder!r} lacks {missing}")
    for name, want in state.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"draft head {name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        state[name] = got.to(want.dtype)
    head.load_state_dict(state)
    return head.to(device).eval().requires_grad_(False)


def load_eagle3_head(folder: str, device: torch.device | str = "cpu") -> Eagle3Head:
    """Read a head folder (config.json + *.safetensors in SGLang's names); weights become
    float32. A missing or mis-shaped tensor is a ValueError naming it."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"draft model folder {folder!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        config = Eagle3Config.from_json(json.load(f))
    # embed_tokens (the target's is used) is ignored when present
    tensors = read_head_tensors(folder)
    if "t2d" not in tensors and "d2t" in tensors:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(config.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return load_head_state(Eagle3Head(config), tensors, folder, device)
