"""The logits head: the final norm, then the LM head's matmul (or only its argmax)."""

from __future__ import annotations

import torch
from torch import nn


class LogitsHead:
    """Final norm + LM head over the rows that need logits. Holds the model's own modules
    (their parameters keep the checkpoint's names: model.norm, lm_head or the tied
    embedding), so it registers nothing itself."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, scale: float = 1.0,
                 softcap: float | None = None) -> None:
        self.norm = norm
        self.lm_head = lm_head
        self.scale = scale  # Granite: 1 / logits_scaling
        self.softcap = softcap  # Gemma 2: logits -> cap * tanh(logits / cap)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (residual stream) -> float32 logits [N, vocab]."""
        logits = self.lm_head(self.norm(x)).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def has_argmax(self) -> bool:
        """Whether the head's kernel finds the argmax without computing every logit."""
        return bool(self.lm_head.has_argmax)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> int64 [N]: the first maximum of each row of `logits(x)` (a
        positive scale and the soft-cap keep the order, so the head's own argmax is it)."""
        return self.lm_head.argmax(self.norm(x))
