"""fp16 weights prepacked for fbgemm: float32 in, float32 out (the LM head of int models)."""

from __future__ import annotations

import functools

import torch
from torch import nn

import kernels.cpu
from sglang_like.quant.base import LinearMethod, WeightSource, dense
from sglang_like.quant.int8 import embed_block_rows, quantize_blocks_int8


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


@functools.cache
def _q8_max_rows() -> int:
    """Rows up to which the native Q8_0 head beats fbgemm's fp16 GEMM (see `apply`)."""
    return 16 if kernels.cpu.isa() == "avx512_vnni" else 4


class Fp16FbgemmMethod(LinearMethod):
    """The weight in fp16 inside fbgemm's packed layout; activations and output stay fp32.

    Why for the head: the int kernels return bf16, and bf16 logits (8 mantissa bits: steps of
    0.06 near 16) tie and blur logprobs; this keeps them fp32 at half of fp32's bytes and was
    faster than the int8 kernel here (2.3 vs 3.2 ms for 49152x576 at batch 1, 18.6 vs 35.9 at
    batch 32, AVX2). With `embed_rows` it also keeps block-int8 rows for the embedding lookup
    (fbgemm's packed layout cannot be gathered by row; a GGUF Q8_0 embedding stays exact).
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
        layer.q8_rows = (self.embed_rows and layer.weight.shape[1] % 32 == 0
                         and layer.block_scale.shape[1] * 32 == layer.weight.shape[1]
                         and kernels.cpu.available())

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.q8_rows and x.shape[0] <= _q8_max_rows():
            # a few rows (small decode batches, verify passes): the block-int8 rows through
            # the native kernel, which reads half fbgemm's bytes and widens each block once
            # for up to four rows; float32 activations, so logits stay float32. Measured for
            # 49152x576 with the caches cold (as after a step's layers), AVX-512: 1.14 / 1.73
            # / 2.91 / 5.09 / 12.2 ms at 1 / 4 / 8 / 16 / 32 rows against fbgemm's 1.88 /
            # 2.78 / 3.37 / 5.09 / 6.72; the AVX2 build crosses fbgemm at about 5 rows. The
            # two round differently (int8 rows vs their fp16 copy: logprobs move by ~1e-3),
            # so the cut is as high as speed allows: batches on either side of it differ
            return kernels.cpu.q8_0_matmul_f32(x, layer.weight, layer.block_scale)
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
