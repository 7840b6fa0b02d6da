"""Idefics3 / SmolVLM's image side: a SigLIP encoder (its final norm applied) over each crop,
then the connector: a pixel shuffle folding scale_factor x scale_factor patches into one token,
and a linear projection (no bias) into the text model's embeddings. The text model is Llama
(SmolLM2 for SmolVLM)."""

from __future__ import annotations

import torch
from torch import nn

from sglang_like.config import VisionConfig
from sglang_like.multimodal.vision import VisionTransformer


class _Projection(nn.Module):
    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(c.hidden_size * c.scale_factor ** 2, text_hidden, bias=False)


class _Connector(nn.Module):
    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.modality_projection = _Projection(c, text_hidden)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[n, side*side, d] -> [n, (side/scale)^2, d*scale^2]: each output token holds a
    scale x scale block of patches (its rows of `scale` patches one after another)."""
    n, t, d = x.shape
    side = int(round(t ** 0.5))
    x = x.view(n, side, side // scale, d * scale)  # neighbours along a row joined
    x = x.transpose(1, 2).reshape(n, side // scale, side // scale, d * scale * scale)
    return x.transpose(1, 2).reshape(n, t // scale ** 2, d * scale ** 2)


class Idefics3Vision(nn.Module):
    """`encode(pixels [crops, 3, S, S])` -> [crops * image_seq_len, text hidden]."""

    def __init__(self, c: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        side = c.patches_per_side
        if side % c.scale_factor:
            raise ValueError(f"{side} patches a side do not shuffle by {c.scale_factor}")
        self.config = c
        self.vision_model = VisionTransformer(c, c.num_hidden_layers, post_norm=True)
        self.connector = _Connector(c, text_hidden)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(self.vision_model(pixels), self.config.scale_factor)
        return self.connector.modality_projection.proj(x).flatten(0, 1)
