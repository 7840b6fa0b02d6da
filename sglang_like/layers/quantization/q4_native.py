"""int4 through this project's own kernels: GGUF Q4_1 blocks, int8 activations.

Two layouts of the same numbers (activations quantized to int8 per 32 columns, as llama.cpp
does; the same sums to float rounding):

- `Q4X16Method` (kernels/sglang_like_kernels/cpu/q4_rows.c), `auto`'s choice wherever the
  native kernels build: 16 output rows interleaved per block, so one `vpdpbusd` (AVX2: two
  `vpmaddubsw` halves) dots 4 columns of all 16 rows and the float scaling is paid per 16
  rows; an activation row costs a few instructions per block, so a speculative verify of 4-8
  rows costs about what one decode row does under torch's kernel. On CPUs with AMX the same
  bytes also feed a tile kernel (amx_kq.c) that gives the same bits, used from
  `amx_min_rows` rows (timings: docs/cpu-kernels.md).
- `Q4NativeMethod` (kernels/sglang_like_kernels/cpu/q4_1.c): row-major blocks, one weight row
  at a time. `SGLANG_LIKE_INT4_KERNEL=native` asks for it.

int8 activations cost a little accuracy against torch's kernel (bf16 activations), within
the int4 bar of 95% top-1 agreement with fp32 (figures: docs/cpu-kernels.md).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from sglang_like.layers.quantization.base import (
    LinearMethod,
    WeightSource,
    dense,
    dense_forward,
    with_bias,
)
from sglang_like.layers.quantization.gguf_blocks import BLOCK, GGUFBlockWeight
from sglang_like_kernels import cpu as native_cpu
from sglang_like_kernels.cpu import amx

Q4_1_BLOCK_BYTES = 20  # fp16 d | fp16 m | 16 nibble bytes
_ENV_VAR = "SGLANG_LIKE_INT4_KERNEL"


def int4_kernel() -> str:
    """Which kernel `int4` linears run: `x16` (Q4X16Method), `native` (Q4NativeMethod) or
    `torch` (Int4Method: torch's int4 kernel, or on AMX this project's tile kernels on
    torch's pack). `SGLANG_LIKE_INT4_KERNEL` = `auto` (default: x16 wherever the native
    kernels are available, else torch), `x16`, `native` or `torch`.

    `auto` picks x16 on AMX CPUs too, by measured speed rather than by ISA
    (benchmarks/bench_kernel_choice.py, docs/cpu-kernels.md): up to 8-16 rows (decode,
    verifies) the x16 kernel is about twice as fast as the tile kernels on torch's pack, the
    one-call decode step (decode_step.c) needs x16 weights, and from 16 rows its own tile
    kernel (amx_kq.c, the same bits) takes over."""
    choice = os.environ.get(_ENV_VAR, "").strip().lower() or "auto"
    if choice not in ("auto", "x16", "native", "torch"):
        raise ValueError(f"{_ENV_VAR}={choice!r}: expected auto, x16, native or torch")
    if choice in ("x16", "native") and not native_cpu.available():
        raise ValueError(f"{_ENV_VAR}={choice} but the native CPU kernels are unavailable")
    if choice != "auto":
        return choice
    return "x16" if native_cpu.available() else "torch"


def int8_blocks_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 on the grid the Q4_1 kernels round activations to: per 32 columns,
    int8 codes times amax / 127 (as q4_1_quantize_row_q8: times the reciprocal, to nearest
    even), so a prefill chunk's dense GEMM multiplies what the kernel would."""
    t, k = x.shape
    xb = x.float().reshape(t, k // BLOCK, BLOCK)
    scale = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(xb * inv) * scale).reshape(t, k)


def q4_1_blocks(source: WeightSource) -> torch.Tensor:
    """The matrix as Q4_1 blocks uint8 [out, in / 32 * 20]: a GGUF Q4_1 file's own bytes,
    Q4_0 with m = -8 d (exact in fp16), anything else quantized per block of 32 (min/max)."""
    if isinstance(source, GGUFBlockWeight) and source.qtype == "Q4_1":
        rows = source.shape[0]
        return torch.from_numpy(np.ascontiguousarray(source.blocks).reshape(rows, -1).copy())
    if isinstance(source, GGUFBlockWeight) and source.qtype == "Q4_0":
        rows, cols = source.shape
        view = np.asarray(source.blocks).reshape(rows, cols // BLOCK, 18)
        d = view[..., 0:2].copy().view(np.float16)
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
        out = np.concatenate([d.view(np.uint8), m.view(np.uint8), view[..., 2:]], axis=-1)
        return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1))
    w = dense(source)
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"Q4_1 needs in_features divisible by {BLOCK}; got {cols}")
    wb = w.reshape(rows, cols // BLOCK, BLOCK)
    lo, hi = wb.amin(dim=-1), wb.amax(dim=-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    d32, m32 = d.float(), m.float()
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    codes = torch.round((wb - m32[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    codes[d32 <= 0] = 0
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    head = torch.stack([d, m], dim=-1).view(torch.uint8)  # [rows, nb, 4]
    return torch.cat([head, nibbles], dim=-1).reshape(rows, -1).contiguous()


class Q4NativeMethod(LinearMethod):
    """Weights as Q4_1 blocks (one copy: the decode kernel reads them, prefill dequantizes
    them); float32 activations in and out. Forwards of `dense_min_rows` rows or more
    dequantize the layer (native, threaded) and run a dense GEMM, as Int4Method does, on the
    activations rounded as the kernel rounds them (`int8_blocks_rounded`): without that, a
    prompt prefilled in a batch (a chunk of 256+ rows) and alone (the kernel) answered
    differently in 10 of 16 greedy 64-token outputs, with it in 2 (bf16 GEMM) or 1 (fp32)."""

    dense_min_rows = 256
    input_dtype = torch.float32

    def __init__(self, batch_invariant: bool = False) -> None:
        # `--enable-deterministic-inference`: the kernel at every row count, a lone row summed
        # as in a batch, so a row's result does not depend on the batch
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self.dense_min_rows = 1 << 62

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        layer.register_buffer("blocks", self._blocks(sources, device))
        layer.group_size = BLOCK

    def _blocks(self, sources: list[WeightSource], device: torch.device) -> torch.Tensor:
        """The partitions' Q4_1 blocks, one matrix (CPU only)."""
        if device.type != "cpu":
            raise ValueError(f"{type(self).__name__} runs on CPU only")
        return torch.cat([q4_1_blocks(s) for s in sources]).contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = layer.blocks.shape[0]
        if x.shape[0] >= self.dense_min_rows:
            return dense_forward(int8_blocks_rounded(x), self.dequantize(layer))
        return native_cpu.q4_1_matmul(x, layer.blocks, n, invariant=self.batch_invariant)

    def decode_fn(self, layer: nn.Module):
        matmul, blocks, n = native_cpu.q4_1_matmul, layer.blocks, layer.blocks.shape[0]
        inv = self.batch_invariant
        return with_bias(lambda x: matmul(x, blocks, n, invariant=inv), layer.bias,
                         torch.float32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        n, row_bytes = layer.blocks.shape
        return native_cpu.q4_1_dequantize(layer.blocks, n, row_bytes // Q4_1_BLOCK_BYTES * BLOCK)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.blocks.numel()


class Q4X16Method(Q4NativeMethod):
    """Weights in the x16 layout (kernels/sglang_like_kernels/cpu/q4_rows.c: 16 output rows
    interleaved per block of 32 columns, 20 bytes per 32 weights as Q4_1); float32
    activations in and out.

    Without AMX, every row count below `dense_min_rows` runs the kernel (a row's result is
    the same alone, in a batch or in a verify); from there the layer is dequantized for a
    GEMM on the activations rounded as the kernel rounds them (see Q4NativeMethod).

    With AMX (`layer.amx`), forwards of `amx_min_rows` rows or more run amx_kq.c on the same
    bytes instead, and nothing is dequantized: its integer tile products are the x16
    kernel's dots and its float steps the x16 kernel's, so a row's result is the same bits
    at every row count, in any batch, chunk or verify. A prefill chunk of 256+ rows through a
    GEMM rounded otherwise, so a prompt's answer depended on how many other prompt rows
    shared its forward, which depends on when requests reach the loop: a greedy comparison
    of two runs of the same 32 prompts (tests/sglang_like/test_greedy_head.py) parted in 20
    of 32 outputs when the first 3 arrived a moment early, in none with this kernel.
    `amx_min_rows`: where the tiles overtake the x16 kernel (bench_kernel_choice)."""

    amx_min_rows = 16

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        blocks = self._blocks(sources, device)
        n = blocks.shape[0]
        k = blocks.shape[1] // Q4_1_BLOCK_BYTES * BLOCK
        layer.register_buffer("x16", native_cpu.q4_x16_pack(blocks, n, k))
        layer.x16_shape = (n, k)
        layer.group_size = BLOCK
        layer.amx = amx.available()

    def _kernel(self, layer: nn.Module, rows: int):
        """The op that multiplies `rows` activation rows: x16, or the tiles (same bits)."""
        if layer.amx and rows >= self.amx_min_rows:
            return amx.q4_x16_matmul
        return native_cpu.q4_x16_matmul

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not layer.amx and x.shape[0] >= self.dense_min_rows:
            return dense_forward(int8_blocks_rounded(x), self.dequantize(layer))
        return self._kernel(layer, x.shape[0])(x, layer.x16, layer.x16_shape[0])

    def decode_fn(self, layer: nn.Module):
        packed, n = layer.x16, layer.x16_shape[0]
        if layer.amx:  # verifies of many rows reach the tiles; every row count the same bits
            kernel = self._kernel
            return with_bias(lambda x: kernel(layer, x.shape[0])(x, packed, n), layer.bias,
                             torch.float32)
        matmul = native_cpu.q4_x16_matmul
        return with_bias(lambda x: matmul(x, packed, n), layer.bias, torch.float32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return native_cpu.q4_x16_dequantize(layer.x16, *layer.x16_shape)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.x16.numel()

    def __repr__(self) -> str:
        return f"Q4X16Method({'batch_invariant=True' if self.batch_invariant else ''})"
