"""Gated activations of an MLP's fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh")
"""Values of `DecoderLayerDescription.activation` the layers implement."""


def gated(gate_up: torch.Tensor, intermediate_size: int, activation: str) -> torch.Tensor:
    """act(gate) * up, where gate_up [T, 2 * intermediate_size] holds gate then up."""
    gate, up = gate_up[:, :intermediate_size], gate_up[:, intermediate_size:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":  # GeGLU (Gemma): gelu's tanh approximation
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unsupported activation {activation!r} (supported: {ACTIVATIONS})")
