"""The linear-method seam: a method owns one linear's weight layout and its matmul."""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight

WeightSource = torch.Tensor | GGUFBlockWeight
"""A loaded weight: a dense [out, in] tensor, or a GGUF matrix still in its blocks."""


def dense(source: WeightSource) -> torch.Tensor:
    """The source as a float32 [out, in] tensor."""
    if isinstance(source, GGUFBlockWeight):
        return source.dequantize()
    return source.float()


_PREFILL_GEMM_ENV = "SGLANG_LIKE_PREFILL_GEMM"


@functools.cache
def prefill_gemm_dtype() -> torch.dtype:
    """The dtype a quantized layer's prefill GEMM runs in, once its weight is dequantized:
    bf16 where the CPU multiplies bf16 in hardware (AMX tiles, or AVX512-BF16), float32
    elsewhere: with AMX, oneDNN's bf16 GEMM is several times faster than fp32 at prefill
    sizes (docs/cpu-kernels.md); on AVX2 bf16 is emulated and slower than fp32.
    int4 and int8 take bf16 activations already, so only the dequantized weight rounds;
    Q4NativeMethod's fp32 activations round too, where it runs with bf16 hardware (it is
    chosen for AVX2-only CPUs, which have neither). Q4X16Method on AMX never comes here: its
    tile kernel takes prefill chunks with the decode kernel's bits.
    `SGLANG_LIKE_PREFILL_GEMM=auto|bf16|fp32` overrides."""
    choice = os.environ.get(_PREFILL_GEMM_ENV, "").strip().lower() or "auto"
    if choice not in ("auto", "bf16", "fp32"):
        raise ValueError(f"{_PREFILL_GEMM_ENV}={choice!r}: expected auto, bf16 or fp32")
    if choice == "auto":
        cpu = torch.cpu
        hardware = (getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                    or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
        choice = "bf16" if hardware and torch.backends.mkldnn.is_available() else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def dense_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32 for a prefill-sized x and a dequantized float32 weight, through
    the GEMM `prefill_gemm_dtype` picks."""
    dtype = prefill_gemm_dtype()
    if dtype == torch.float32:
        return torch.nn.functional.linear(x.float(), weight)
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype)).float()


class LinearMethod(ABC):
    """How a linear layer stores its weight and computes `x @ W.T (+ b)`.

    The model names its linears and hands each one the weights of its partitions (q, k, v for
    a fused qkv; gate, up); `create_weights` stacks them along the output dim into whatever
    layout the method's kernel wants, once, at load, and registers the result as buffers of
    the layer. `apply` is the hot path; it may assume `x` is 2-D in `input_dtype`. A method
    object holds no per-layer state, so one instance serves every layer.
    """

    #: dtype `apply` wants its input in (the model's norms write this dtype)
    input_dtype: torch.dtype = torch.float32

    @abstractmethod
    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        """Register the packed weight of `layer` built from its partitions' sources."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out] in `input_dtype` (bias not included)."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 [out, in] matrix `apply` really multiplies by (tests, debugging)."""

    def decode_fn(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`layer(x)` for a decode-sized x (a few rows, already in `input_dtype`), as a
        closure over the layer's buffers: the native decode path calls it 120 times a step,
        so methods whose kernel is one op return that op without the module's per-call
        Python. Default: the module itself."""
        return layer.forward

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the matrix as float32 [T, in] (for an embedding that is also a head)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as an embedding")

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes this layer's weights hold in memory."""
        return sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))

    def decode_bytes(self, layer: nn.Module) -> int:
        """Bytes one decode step reads (the bandwidth floor's numerator)."""
        return self.weight_bytes(layer)

    def __repr__(self) -> str:
        return type(self).__name__


def with_bias(fn: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn, plus the layer's bias (cast once to the kernel's output dtype, as QuantLinear adds
    it) when it has one."""
    if bias is None:
        return fn
    b = bias.to(out_dtype)
    return lambda x: fn(x) + b
