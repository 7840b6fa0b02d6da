"""int4 through this project's own kernel (kernels/cpu/q4_1.c): GGUF Q4_1 blocks, int8 activations.

Chosen for `int4` where torch's int4 kernel is its AVX2 path, which is compute-bound: the
whole 120-matmul decode step of the default model measured 4.6 ms there against 2.2 ms
through this kernel (torch forced to AVX2 on an AVX-512 machine, `ATEN_CPU_CAPABILITY=avx2`).
On AVX-512 torch's kernel is the faster one (1.7 vs 2.0 ms) and `Int4Method` stays.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

import kernels.cpu
from sglang_like.quant.base import LinearMethod, WeightSource, dense, dense_forward, with_bias
from sglang_like.quant.gguf_blocks import BLOCK, GGUFBlockWeight

Q4_1_BLOCK_BYTES = 20  # fp16 d | fp16 m | 16 nibble bytes
_ENV_VAR = "SGLANG_LIKE_INT4_KERNEL"


def prefer_native_q4() -> bool:
    """Whether `int4` linears use Q4NativeMethod: `SGLANG_LIKE_INT4_KERNEL` = `native`,
    `torch`, or `auto` (default: native where torch's int4 kernel runs its AVX2 code)."""
    choice = os.environ.get(_ENV_VAR, "").strip().lower() or "auto"
    if choice not in ("auto", "native", "torch"):
        raise ValueError(f"{_ENV_VAR}={choice!r}: expected auto, native or torch")
    if choice == "torch":
        return False
    if choice == "native":
        if not kernels.cpu.available():
            raise ValueError(f"{_ENV_VAR}=native but the native CPU kernels are unavailable")
        return True
    return kernels.cpu.available() and torch.backends.cpu.get_cpu_capability() == "AVX2"


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
    dequantize the layer (native, threaded) and run fp32 GEMM, as Int4Method does."""

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
        if device.type != "cpu":
            raise ValueError("Q4NativeMethod runs on CPU only")
        blocks = torch.cat([q4_1_blocks(s) for s in sources]).contiguous()
        layer.register_buffer("blocks", blocks)
        layer.group_size = BLOCK

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = layer.blocks.shape[0]
        if x.shape[0] >= self.dense_min_rows:
            return dense_forward(x, self.dequantize(layer))
        return kernels.cpu.q4_1_matmul(x, layer.blocks, n, invariant=self.batch_invariant)

    def decode_fn(self, layer: nn.Module):
        matmul, blocks, n = kernels.cpu.q4_1_matmul, layer.blocks, layer.blocks.shape[0]
        inv = self.batch_invariant
        return with_bias(lambda x: matmul(x, blocks, n, invariant=inv), layer.bias,
                         torch.float32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        n, row_bytes = layer.blocks.shape
        return kernels.cpu.q4_1_dequantize(layer.blocks, n, row_bytes // Q4_1_BLOCK_BYTES * BLOCK)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.blocks.numel()
