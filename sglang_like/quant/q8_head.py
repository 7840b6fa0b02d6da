"""The LM head (and tied embedding) of a quantized model as block-int8 rows on the native
Q8_0 kernel: float32 activations in, float32 logits out, one copy of the matrix."""

from __future__ import annotations

import functools

import torch
from torch import nn

import kernels.cpu
import kernels.cpu.amx
from sglang_like.quant.base import WeightSource
from sglang_like.quant.int8 import EMBED_BLOCK, Int8EmbeddingMethod, quantize_blocks_int8


@functools.cache
def q8_head_available() -> bool:
    """Whether the native Q8_0 kernel is built on this machine (x86 with AVX2 and a compiler)."""
    return kernels.cpu.available()


class Q8HeadMethod(Int8EmbeddingMethod):
    """The embedding's block-int8 rows (a GGUF Q8_0 matrix kept exactly, anything else
    quantized at load; `embed` and `dequantize` as there), multiplied by
    `kernels.cpu.q8_0_matmul_f32` whatever the row count.

    Why one copy at int8: the head is the model's largest matrix (49152x576 on the default
    model). An fp16 copy for fbgemm's GEMM besides the rows the embedding gathers took 96 MB
    of resident memory (fbgemm's packed form) for 57 MB of weights. The int8 kernel is
    faster than fbgemm up to about 16 rows and slower above (measured with the caches cold,
    AVX-512: 1.3 / 1.6 / 2.5 / 4.6 / 9.4 / 18 ms at 1 / 4 / 8 / 16 / 32 / 64 rows, fbgemm
    1.8 / 2.7 / 3.5 / 4.7 / 6.5 / 11); a decode step of 32 rows spends about 3 ms more on
    the head and the model is 96 MB smaller. Every row count runs the same sums per row, so
    logits do not depend on the batch (fbgemm's fp16 copy rounds otherwise: a row's logprobs
    moved by about 1e-3 across a cut between the two).

    On CPUs with AMX, forwards of `amx_min_rows` rows or more run kernels/cpu/amx_q8.c
    instead: weights (code x scale) and activations each as two bf16 parts on the tile unit,
    which keeps the float product (4e-6 relative): 4.7 ms against 10.8 at 32 rows, 7.4
    against 22 at 64, 3.5 against 5.6 at 16 (3.3 against 0.9 at one row, where the int8 kernel
    stays). Their sums differ in the last bits, so `batch_invariant` keeps the int8 kernel at
    every row count.
    """

    amx_min_rows = 12

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        parts = [quantize_blocks_int8(s) for s in sources]  # a fused linear's partitions too
        codes = torch.cat([c for c, _ in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
        if codes.shape[1] % EMBED_BLOCK != 0:
            raise ValueError(f"the Q8_0 head needs in_features % {EMBED_BLOCK} == 0")
        layer.register_buffer("weight", codes.contiguous().to(device))
        layer.register_buffer("block_scale", scale.contiguous().to(device))
        n, k = codes.shape
        layer.amx = (not self.batch_invariant and n % 32 == 0 and k % 32 == 0
                     and device.type == "cpu" and kernels.cpu.amx.available())

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.amx and x.shape[0] >= self.amx_min_rows:
            return kernels.cpu.amx.q8_matmul(x, layer.weight, layer.block_scale)
        return kernels.cpu.q8_0_matmul_f32(x, layer.weight, layer.block_scale)

    def decode_bytes(self, layer: nn.Module) -> int:
        return self.weight_bytes(layer)  # every step reads the whole head
