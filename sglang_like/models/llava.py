"""LLaVA's image side: a CLIP or SigLIP encoder read at `vision_feature_layer` (the class token
dropped for the "default" strategy) and a two-layer MLP projector into the text model's
embeddings. The text model is any family of the registry (`text_config`)."""

from __future__ import annotations

import torch
from torch import nn

from sglang_like.config import VisionConfig
from sglang_like.multimodal.vision import VisionTransformer, activation, layers_needed


class _Tower(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        # post_layernorm only ever follows the last layer, which LLaVA's feature layer reads
        # without it (hidden_states[-1] is the encoder's output before the norm)
        self.vision_model = VisionTransformer(c, layers_needed(c), post_norm=False)


class _Projector(nn.Module):
    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(c.hidden_size, text_hidden, bias=c.projector_bias)
        self.act = activation(c.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=c.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """`encode(pixels [n, 3, S, S])` -> [n * tokens_per_image, text hidden] embedding rows."""

    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        if c.feature_select not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {c.feature_select!r} unsupported")
        self.config = c
        self.vision_tower = _Tower(c)
        self.multi_modal_projector = _Projector(c, text_hidden)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.vision_tower.vision_model(pixels)
        if self.config.feature_select == "default" and self.config.encoder == "clip":
            x = x[:, 1:]
        return self.multi_modal_projector(x).flatten(0, 1)
