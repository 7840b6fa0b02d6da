"""QuantLinear: a linear layer whose weight layout and matmul belong to its LinearMethod."""

from __future__ import annotations

import torch
from torch import nn

from sglang_like.layers.lora import LoraContext, apply_lora
from sglang_like.layers.quantization.base import LinearMethod, WeightSource


class QuantLinear(nn.Module):
    """`y = x @ W.T (+ b)` with W stacked from `partitions` (HF names, e.g. q/k/v_proj).

    `output_sizes` are the partitions' row counts, so a fused projection splits its output
    with `split`. Weights arrive through `load_weights` (buffers, not parameters: they never
    train and their dtype is the method's). The bias, when there is one, stays float32 and
    is added in the output dtype.
    """

    def __init__(self, method: LinearMethod, in_features: int, output_sizes: list[int],
                 partitions: list[str], bias: bool = False) -> None:
        super().__init__()
        if len(output_sizes) != len(partitions):
            raise ValueError("one output size per partition")
        self.method = method
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.partitions = list(partitions)
        self.has_bias = bias
        self.register_buffer("bias", None)
        # LoRA: the model's context (the forward's rows by adapter) and this linear's key in
        # an adapter's weights; None where the model serves no adapters on it
        self.lora_ctx: LoraContext | None = None
        self.lora_key = ""

    @property
    def out_features(self) -> int:
        return sum(self.output_sizes)

    def load_weights(self, weights: dict[str, WeightSource], prefix: str,
                     device: torch.device) -> None:
        sources = [weights[f"{prefix}{p}.weight"] for p in self.partitions]
        for p, s, rows in zip(self.partitions, sources, self.output_sizes, strict=True):
            if tuple(s.shape) != (rows, self.in_features):
                raise ValueError(f"{prefix}{p}.weight: checkpoint shape {tuple(s.shape)} != "
                                 f"model {(rows, self.in_features)}")
        self.method.create_weights(self, sources, device)
        if self.has_bias:
            bias = torch.cat([weights[f"{prefix}{p}.bias"].float() for p in self.partitions])
            self.register_buffer("bias", bias.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.method.input_dtype:  # e.g. attention's fp32 output into a bf16 matmul
            x = x.to(self.method.input_dtype)
        y = self.method.apply(self, x)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        lora = self.lora_ctx.batch if self.lora_ctx is not None else None
        return y if lora is None else apply_lora(y, x, self.lora_key, lora)

    @property
    def has_argmax(self) -> bool:
        """Whether `argmax` has a path of its own here (the LM head's, on some CPUs)."""
        supported = getattr(self.method, "argmax_supported", None)
        return self.bias is None and supported is not None and supported(self)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: each row's argmax of `forward(x)` (the first among equals, NaN as the
        maximum), where `has_argmax`; it need not compute every logit in full."""
        if x.dtype != self.method.input_dtype:
            x = x.to(self.method.input_dtype)
        return self.method.argmax(self, x)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.output_sizes}, parts={self.partitions}, "
                f"method={self.method!r}")
