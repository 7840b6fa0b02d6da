"""Rotary position embedding (rotate-half layout) with the scalings Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), applied by gathering on position ids."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str,
    ) -> None:
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos().to(torch.float32).to(device)  # [P, D/2]
        self.sin = freqs.sin().to(torch.float32).to(device)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated copies (computed in fp32, returned in q dtype)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
