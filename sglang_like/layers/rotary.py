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
        cos = freqs.cos().to(torch.float32)  # [P, D/2]
        sin = freqs.sin().to(torch.float32)
        # full-width rows for the per-forward tables: [cos, cos] and [-sin, sin]
        self._cos_full = torch.cat([cos, cos], dim=-1).to(device)  # [P, D]
        self._sin_signed = torch.cat([-sin, sin], dim=-1).to(device)

    @property
    def cos_table(self) -> torch.Tensor:
        """[P, D] float32 rows [cos, cos] (native kernels index it by position)."""
        return self._cos_full

    @property
    def sin_table(self) -> torch.Tensor:
        """[P, D] float32 rows [-sin, sin]."""
        return self._sin_signed

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The cos/sin rows of `positions` [T], for every layer of one forward."""
        return RotaryTables(self._cos_full[positions], self._sin_signed[positions])


class RotaryTables:
    """cos/sin rows of one forward's positions, gathered once and shared by every layer."""

    def __init__(self, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> None:
        self.cos = cos_full.unsqueeze(1)  # [T, 1, D]: [cos, cos]
        self.sin = sin_signed.unsqueeze(1)  # [T, 1, D]: [-sin, sin]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotate-half RoPE applied, in float32 (attention's dtype, so a bf16
        model casts once here rather than in the KV store and the attention).

        rotate_half(x) * [sin, sin] == roll(x, D/2) * [-sin, sin]: three ops in all.
        """
        xf = x.float()
        return torch.addcmul(xf * self.cos, xf.roll(x.shape[-1] // 2, dims=-1), self.sin)
