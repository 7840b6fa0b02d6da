"""The LM head (and tied embedding) of a quantized model as block-int8 rows on the native
Q8_0 kernel: float32 activations in, float32 logits out, one copy of the matrix."""

from __future__ import annotations

import functools

import torch
from torch import nn

from sglang_like.layers.quantization.base import WeightSource
from sglang_like.layers.quantization.int8 import (
    EMBED_BLOCK,
    Int8EmbeddingMethod,
    quantize_blocks_int8,
)
from sglang_like_kernels import cpu as native_cpu
from sglang_like_kernels.cpu import amx
from sglang_like_kernels.cpu.ops import argmax_rows


@functools.cache
def q8_head_available() -> bool:
    """Whether the native Q8_0 kernel is built on this machine (x86 with AVX2 and a compiler)."""
    return native_cpu.available()


class Q8HeadMethod(Int8EmbeddingMethod):
    """The embedding's block-int8 rows (a GGUF Q8_0 matrix kept exactly, anything else
    quantized at load; `embed` and `dequantize` as there), multiplied by
    `sglang_like_kernels.cpu.q8_0_matmul_f32` whatever the row count (faster kernels below).

    Why one copy at int8: the head is the model's largest matrix (49152x576 on the default
    model). An fp16 copy for fbgemm's GEMM besides the rows the embedding gathers took more
    resident memory (fbgemm's packed form) than the weights themselves. The int8 kernel is
    faster than fbgemm up to about 16 rows and slower above, a price paid for a smaller model
    and for logits that do not depend on the batch: every row count runs the same sums per
    row (a cut over to fbgemm's fp16 copy would round otherwise). Timings:
    docs/cpu-kernels.md.

    On CPUs with AVX-512 VNNI (AMX ones included), the rows are repacked 16 at a time for
    kernels/sglang_like_kernels/cpu/q8_rows.c, which rounds the activations to two int8 parts
    per 32 columns (about 15 bits: logits within 2e-5 of the float product's norm; one int8
    part cost top-1 agreement with fp32) and dots 16 rows' codes per instruction, about twice
    as fast as the float kernel or more, and gives greedy rows their argmax without every
    logit (`argmax`). Every row count runs the same sums per row. With AMX, from
    `amx_min_rows` rows the same bytes go through amx_q8x16.c instead: its tile products are
    that kernel's integer dots and its scaling that kernel's, so the logits are the same bits
    at every row count, on one copy of the matrix. On AVX2 the x16 kernel was no faster than
    the float kernel (even with one part), which stays there.

    `row_major_amx` keeps the rows row-major for amx_q8.c's kernels instead (what AMX CPUs ran
    before the x16 tiles; benchmarks/bench_kernel_choice.py compares the two): below
    `row_major_amx_min_rows` rows an integer kernel (activations as two int8 parts, one
    scaling per block), from there a bf16 one (weights and activations as two bf16 parts each,
    4e-6 relative), which round differently, so `batch_invariant` keeps the integer kernel at
    every row count there. It has no argmax path, and it was slower than the x16 kernel up to
    8 rows (2x at one).
    """

    amx_min_rows = 8  # the x16 tiles from here (bench_kernel_choice)
    row_major_amx_min_rows = 24
    argmax_min_rows = 12  # fewer rows: the logits and their argmax (see `argmax`)

    def __init__(self, batch_invariant: bool = False, row_major_amx: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self.row_major_amx = row_major_amx

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        parts = [quantize_blocks_int8(s) for s in sources]  # a fused linear's partitions too
        codes = torch.cat([c for c, _ in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
        if codes.shape[1] % EMBED_BLOCK != 0:
            raise ValueError(f"the Q8_0 head needs in_features % {EMBED_BLOCK} == 0")
        n, k = codes.shape
        on_cpu_amx = device.type == "cpu" and amx.available()
        layer.amx = self.row_major_amx and n % 32 == 0 and k % 32 == 0 and on_cpu_amx
        layer.x16 = (not layer.amx and n % 16 == 0 and device.type == "cpu"
                     and native_cpu.isa() == "avx512_vnni")
        layer.x16_amx = layer.x16 and on_cpu_amx
        if layer.x16:  # one copy, in the kernel's layout; embed() gathers rows out of it
            codes, scale = native_cpu.q8_x16_pack(codes.contiguous(), scale.contiguous())
        layer.register_buffer("weight", codes.contiguous().to(device))
        layer.register_buffer("block_scale", scale.contiguous().to(device))
        if layer.x16:  # a float a row: what `argmax` bounds a logit's second part with
            layer.register_buffer("row_bounds",
                                  native_cpu.q8_x16_row_bounds(layer.weight, layer.block_scale))

    def _rows(self, layer: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.x16:
            return native_cpu.q8_x16_rows(layer.weight, layer.block_scale, ids)
        return layer.weight[ids], layer.block_scale[ids]

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        codes, scale = self._rows(layer, ids)
        t, k = codes.shape
        return (codes.float().view(t, scale.shape[1], -1) * scale.unsqueeze(-1)).view(t, k)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        n = layer.weight.shape[0] * (16 if layer.x16 else 1)
        return self.embed(layer, torch.arange(n, device=layer.weight.device))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.x16:
            tiles = layer.x16_amx and x.shape[0] >= self.amx_min_rows  # the same bits
            matmul = amx.q8_x16_matmul if tiles else native_cpu.q8_x16_matmul
            return matmul(x, layer.weight, layer.block_scale)
        if layer.amx:
            int8 = self.batch_invariant or x.shape[0] < self.row_major_amx_min_rows
            return amx.q8_matmul(x, layer.weight, layer.block_scale, int8=int8)
        return native_cpu.q8_0_matmul_f32(x, layer.weight, layer.block_scale)

    def argmax_supported(self, layer: nn.Module) -> bool:
        return layer.x16

    def argmax(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Greedy rows on the x16 kernel: from `argmax_min_rows` rows `q8_x16_argmax`, the
        first activation part for every logit and both only for the 16-row groups that can
        hold the maximum (on the default model 4-10 groups of 3072 a row); below, the logits
        and their argmax. The same index either way. It saves time from about 12 rows, not
        below (docs/cpu-kernels.md)."""
        if x.shape[0] < self.argmax_min_rows:
            return torch.tensor(argmax_rows(self.apply(layer, x)), dtype=torch.int64)
        return native_cpu.q8_x16_argmax(x, layer.weight, layer.block_scale, layer.row_bounds)[0]

    def decode_bytes(self, layer: nn.Module) -> int:
        return self.weight_bytes(layer)  # every step reads the whole head
