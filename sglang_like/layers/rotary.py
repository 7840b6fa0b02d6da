"""Rotary position embedding (rotate-half layout) with the scalings Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any], model_max: int
          ) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated by `factor`, those turning more than `beta_fast` times kept, a linear ramp
    between; scores scaled by 0.1 ln(factor) + 1 (through cos/sin) unless the config says."""
    orig = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or model_max / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                if mscale and mscale_all else _yarn_mscale(factor))

    def dim_of(rotations: float) -> float:  # the dim index that turns `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1 / (factor * base)) * (1 - keep) + (1 / base) * keep, float(attn)


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
              model_max: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of a `dim`-wide rotation, factor on cos/sin) for a context of
    `max_positions` served of a model trained to `model_max` (its max_position_embeddings).

    The scalings whose frequencies depend on the sequence's length in transformers (`dynamic`,
    `longrope`) are fixed here by the context served, as llama.cpp fixes them by its context
    size: within the original context they equal transformers'."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == "dynamic":  # NTK-aware base, grown once the context passes the trained one
        if max_positions <= model_max:
            return inv_freq, 1.0
        factor = float(scaling["factor"])
        base = theta * ((factor * max_positions / model_max) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, model_max)
    if kind in ("longrope", "su"):  # Phi-3: per-frequency factors, long past the original
        orig = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or model_max / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = scaling["long_factor"] if max_positions > orig else scaling["short_factor"]
        return inv_freq / torch.tensor(ext, dtype=torch.float64), float(attn)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), applied by gathering on position ids.

    With `rotary_dim` < head_dim (partial rotary) only that many dims turn; the loader has
    ordered each head's q/k rows so that the rotated pairs sit at (i, i + head_dim / 2) like a
    full rotation's (`partial_rotary_order`), and the other dims get cos 1, sin 0."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str,
        rotary_dim: int | None = None,
        model_max_positions: int | None = None,
    ) -> None:
        dim = rotary_dim or head_dim
        inv_freq, attn = _inv_freq(dim, theta, scaling, max_positions,
                                   model_max_positions or max_positions)
        if dim < head_dim:  # zero frequency: the pass-through dims
            inv_freq = torch.cat([inv_freq, inv_freq.new_zeros((head_dim - dim) // 2)])
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cos = (freqs.cos() * attn).to(torch.float32)  # [P, D/2]
        sin = (freqs.sin() * attn).to(torch.float32)
        if dim < head_dim:
            cos[:, dim // 2:] = 1.0  # pass-through dims are not scaled either
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


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that puts a partial rotation's pairs where a full one has
    them: rotate-half over the first `rotary_dim` dims pairs (i, i + rotary_dim / 2); after
    this order, dims (i, i + head_dim / 2) are those pairs for i < rotary_dim / 2, and
    pass-through dims paired with each other (turned by cos 1, sin 0) beyond. Scores are
    unchanged when q and k are reordered alike."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(r), *range(rotary_dim, rotary_dim + p)]
    second = [*range(r, rotary_dim), *range(rotary_dim + p, head_dim)]
    return torch.tensor(first + second)


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
