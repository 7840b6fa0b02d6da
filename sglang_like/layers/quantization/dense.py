"""Dense weights (float32 / bfloat16 / float16): the exact path, and CUDA's default."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_like.layers.quantization.base import LinearMethod, WeightSource, dense


class DenseMethod(LinearMethod):
    """`F.linear` on a weight held in `dtype`; the input is in `dtype` too."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.input_dtype = dtype

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        weight = torch.cat([dense(s) for s in sources]) if len(sources) > 1 else dense(sources[0])
        layer.register_buffer("weight", weight.to(device=device, dtype=self.input_dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight).float()

    def __repr__(self) -> str:
        return f"DenseMethod({str(self.input_dtype).removeprefix('torch.')})"
