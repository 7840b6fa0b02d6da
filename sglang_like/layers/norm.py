"""Normalization layers: RMSNorm computed in float32, written in the dtype the next matmul wants."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; the result is written in `out_dtype` (the dtype the next
    matmul wants), so a quantized model casts once per norm rather than once per linear."""

    def __init__(self, dim: int, eps: float, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's formula, x * rsqrt(mean(x^2) + eps) * w, in place on its own temporaries: the
        # same bits as F.rms_norm, and fewer temporaries (faster per call on CPU)
        xf = x.float()
        inv = torch.mean(xf * xf, dim=-1, keepdim=True).add_(self.eps).rsqrt_()
        return torch.mul(xf, inv).mul_(self.weight).to(self.out_dtype)
