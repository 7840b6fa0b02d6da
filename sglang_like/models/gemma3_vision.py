"""Gemma 3's image side: a SigLIP encoder (its final norm applied), its patches average-pooled
to `mm_tokens_per_image` (256) tokens, an RMSNorm of Gemma's kind (x * (1 + w), in float32)
and a projection into the text model's embeddings. The text model is Gemma 3's (models/gemma.py);
an image's embedding rows attend to each other both ways there (model_runner's image masks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_like.config import VisionConfig
from sglang_like.multimodal.vision import VisionTransformer


class _Tower(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(c, c.num_hidden_layers, post_norm=True)


class _SoftEmbNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class _Projector(nn.Module):
    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(c.hidden_size, text_hidden))
        self.mm_soft_emb_norm = _SoftEmbNorm(c.hidden_size, c.layer_norm_eps)


class Gemma3Vision(nn.Module):
    """`encode(pixels [n, 3, S, S])` -> [n * tokens_per_image, text hidden]."""

    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        side = c.patches_per_side
        per_side = int(round(c.tokens_per_image ** 0.5))
        if per_side * per_side != c.tokens_per_image or side % per_side:
            raise ValueError(f"{c.tokens_per_image} tokens per image do not pool from "
                             f"{side}x{side} patches")
        self.config = c
        self.kernel = side // per_side
        self.vision_tower = _Tower(c)
        self.multi_modal_projector = _Projector(c, text_hidden)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.vision_tower.vision_model(pixels)  # [n, side*side, d]
        n, t, d = x.shape
        side = self.config.patches_per_side
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        proj = self.multi_modal_projector
        return (proj.mm_soft_emb_norm(pooled) @ proj.mm_input_projection_weight).flatten(0, 1)
