"""fp16 weights prepacked for fbgemm: float32 in, float32 out (the LM head of int models)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from sglang_like.layers.quantization.base import LinearMethod, WeightSource, dense
from sglang_like.layers.quantization.int8 import embed_block_rows, quantize_blocks_int8


@functools.lru_cache(maxsize=1)
def fbgemm_fp16_available() -> bool:
    """fbgemm's fp16 GEMM needs an x86 CPU with AVX2 (AVX-512 too) and a build that has it."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except (RuntimeError, AttributeError):
        return False
    return True


class Fp16FbgemmMethod(LinearMethod):
    """The weight in fp16 inside fbgemm's packed layout; activations and output stay fp32.

    The head of a quantized model where the native Q8_0 kernel is not built (see q8_head)
    but fbgemm is: the int kernels return bf16, and bf16 logits (8 mantissa bits: steps of
    0.06 near 16) tie and blur logprobs; this keeps them fp32 at half of fp32's bytes. With
    `embed_rows` it also keeps block-int8 rows for the embedding lookup (fbgemm's packed
    layout cannot be gathered by row; a GGUF Q8_0 embedding stays exact).
    """

    input_dtype = torch.float32

    def __init__(self, embed_rows: bool) -> None:
        self.embed_rows = embed_rows

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        weight = torch.cat([dense(s) for s in sources]) if len(sources) > 1 else dense(sources[0])
        layer.packed_fp16 = torch.ops.quantized.linear_prepack_fp16(weight, None)
        layer.fp16_bytes = weight.numel() * 2
        if self.embed_rows:
            codes, scale = quantize_blocks_int8(sources[0] if len(sources) == 1 else weight)
            layer.register_buffer("weight", codes)
            layer.register_buffer("block_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, layer.packed_fp16)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight, _ = torch.ops.quantized.linear_unpack_fp16(layer.packed_fp16)
        return weight.float()

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if not self.embed_rows:
            raise NotImplementedError("this head keeps no embedding rows")
        return embed_block_rows(layer.weight, layer.block_scale, ids)

    def weight_bytes(self, layer: nn.Module) -> int:
        rows = layer.weight.numel() + layer.block_scale.numel() * 4 if self.embed_rows else 0
        return layer.fp16_bytes + rows

    def decode_bytes(self, layer: nn.Module) -> int:
        return layer.fp16_bytes  # a step gathers only a few embedding rows
