"""The vision encoders vision-language models put before their projector: a ViT in CLIP's
layout (a class token, a norm before the encoder) or SigLIP's (neither; Idefics3's is SigLIP's).
Module names follow the checkpoints' (`embeddings.patch_embedding`, `encoder.layers.N.self_attn.
q_proj`, ...) so a state dict loads as saved. Attention is bidirectional over the patches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang_like.config import VisionConfig


def activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return _QuickGelu()
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    if name == "silu":
        return nn.SiLU()
    raise ValueError(f"unsupported vision activation {name!r}")


class _QuickGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class _Embeddings(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.has_cls = c.encoder == "clip"
        self.patch_embedding = nn.Conv2d(3, c.hidden_size, c.patch_size, c.patch_size,
                                         bias=not self.has_cls)
        num = c.patches_per_side ** 2 + (1 if self.has_cls else 0)
        self.position_embedding = nn.Embedding(num, c.hidden_size)
        if self.has_cls:
            self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.side = c.patches_per_side

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        n, _, h, w = x.shape
        if (h, w) != (self.side, self.side):
            raise ValueError(f"the vision encoder takes {self.side}x{self.side} patches, got "
                             f"{h}x{w}")
        x = x.flatten(2).transpose(1, 2)
        if self.has_cls:
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)
        return x + self.position_embedding.weight[None]


class _Attention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // self.heads))
        return self.out_proj(y.transpose(1, 2).reshape(n, t, d))


class _Mlp(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = activation(c.hidden_act)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = _Attention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = _Mlp(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """`forward(pixels [n, 3, S, S])` -> the hidden states after `num_layers` encoder layers
    ([n, tokens, hidden]; the class token first for CLIP), normed by `post_layernorm` when
    `post_norm`. A model that reads an inner layer builds only the layers it reads."""

    def __init__(self, c: VisionConfig, num_layers: int, post_norm: bool) -> None:
        super().__init__()
        self.embeddings = _Embeddings(c)
        if c.encoder == "clip":
            self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)  # sic: CLIP's
        self.encoder = _Encoder(c, num_layers)
        if post_norm:
            self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        if hasattr(self, "post_layernorm"):
            x = self.post_layernorm(x)
        return x


def layers_needed(c: VisionConfig) -> int:
    """How many encoder layers produce `feature_layer` (transformers' hidden_states index:
    0 is the embeddings, -1 the last layer's output)."""
    k = c.feature_layer if c.feature_layer >= 0 else c.num_hidden_layers + 1 + c.feature_layer
    if not 0 <= k <= c.num_hidden_layers:
        raise ValueError(f"vision feature layer {c.feature_layer} is outside the encoder's "
                         f"{c.num_hidden_layers} layers")
    return k
