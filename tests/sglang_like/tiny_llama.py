"""A tiny random llama for the tests that step a real model under the CUDA profile."""

from __future__ import annotations

import torch

from sglang_like.config import ModelConfig
from sglang_like.model_loader.loaded import expected_weight_shapes

TINY = ModelConfig("llama", 97, 64, 192, 2, 6, 3, 16, max_position_embeddings=64)


def tiny_weights(config: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded N(0, 0.2) weights, norms near 1, under the names the model loads."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0)
            for name, shape in expected_weight_shapes(config).items()}
