"""Weight-only int4, asymmetric per group of K: torch's `_weight_int4pack_mm_for_cpu`."""

from __future__ import annotations

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
from sglang_like_kernels.cpu import amx

_GGUF_INT4 = ("Q4_0", "Q4_1")


def quantize_groups_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K] in 0..15, scale, zero fp32 [N, K/g]) with w ~ (code-8)*scale+zero.

    Scale and zero are rounded to bf16 (the kernel's dtype) before the codes are chosen, so
    the codes fit the values the kernel will really use.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).bfloat16().float()
    zero = (lo + 8.0 * scale).bfloat16().float()
    low = zero - 8.0 * scale
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scale, zero


def _unpack_blocked(packed: torch.Tensor, block_n: int) -> torch.Tensor:
    """Codes [N, K] uint8 from torch's x86 int4 layout with `block_n` rows per block: the
    bytes are [N/block_n, K, block_n/2], byte j of (block, k) holding row j of the block in
    its low nibble and row j + block_n/2 in its high one."""
    n, half_k = packed.shape
    k = 2 * half_k
    blocks = packed.view(n // block_n, k, block_n // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [N/block_n, K, block_n]
    return codes.transpose(1, 2).reshape(n, k)


def _blocked_layout(packed: torch.Tensor, codes: torch.Tensor) -> int | None:
    """The block size when `packed` holds `codes` in the blocked layout `_unpack_blocked`
    reads (64 rows on AVX-512, 32 on AVX2 in torch 2.13), else None. Checked against the
    codes themselves, so another torch or ISA that packs otherwise keeps a nibble copy."""
    n, k = codes.shape
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
        return None
    for block_n in (64, 32, 16):
        if n % block_n == 0 and torch.equal(_unpack_blocked(packed, block_n), codes):
            return block_n
    return None


class Int4Method(LinearMethod):
    """int4 codes packed for the host CPU (the layout depends on its ISA: pack where it runs)
    with bf16 (scale, zero) per group of `group_size` input columns; bf16 activations.

    GGUF Q4_0 / Q4_1 blocks map onto it code for code at group size 32 (only their f16 scales
    round to bf16); other sources are quantized at load with `group_size`.

    The kernel is compute-bound on AVX2 and falls behind MKL's fp32 GEMM once a forward has a
    few hundred rows, so prefill chunks of `dense_min_rows` rows or more dequantize the layer
    into fp32 and run a dense GEMM (`base.dense_forward`: bf16 on CPUs with bf16 matrix
    hardware). The codes are read back out of the kernel's own layout when it is the blocked one
    torch uses on x86 (see `_blocked_layout`); where it is not, a portable nibble copy is kept
    (+0.5 byte per weight).

    On CPUs with AMX (Sapphire Rapids and later), every forward runs an AMX kernel on the
    same bytes instead, chosen by row count. (`auto` runs Q4X16Method there now, faster at
    decode sizes; this method is `SGLANG_LIKE_INT4_KERNEL=torch`'s.) From about 64 rows the
    bf16 kernel is as fast or faster, but the codes kernel keeps every forward below 256 rows
    on one kernel (verifies of a batch of 20 run 120 rows; a prompt's first prefill and its
    cached re-extend run different row counts): with a switch at 64, those answered
    measurably apart. The timings by row count are in docs/cpu-kernels.md.

    - Below `amx_bf16_min_rows` (decode, speculative verifies, short prompts) the codes
      kernel: the activations rounded onto a grid per 32 columns on which every dot is an
      exact float, then the codes as exact bf16 integers on the tiles (or, up to 4 rows,
      integer dots on VNNI: the same numbers). So a row's result is the same bits alone or
      in any batch below that size: a lone decode, its verify, a batch of 32 and a cached
      prompt's extend all agree.
    - From there (prefill chunks) the bf16 kernel: each weight dequantized once per call
      into two bf16 parts.
    Both multiply the exact weights, as torch's kernel does (1.7e-3 relative error on the
    default model's layers: the bf16 output's rounding). One kernel for every row count
    below 256, because the int4 path's bf16 activations amplify a single rounding flip over
    30 layers (0.6 in a residual feature, 0.1 nats in a logprob): with a kernel per row
    count a lone decode, a batch, a speculative verify and a cached prompt's extend would
    answer slightly differently. `batch_invariant` runs the codes kernel (off AMX, torch's)
    at every row count.
    """

    dense_min_rows = 256
    amx_bf16_min_rows = dense_min_rows

    input_dtype = torch.bfloat16

    def __init__(self, group_size: int = 64, batch_invariant: bool = False) -> None:
        if group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size must be 32, 64, 128 or 256; got {group_size}")
        self.group_size = group_size
        # one kernel at every row count: AMX's integer one where the layer runs on AMX
        self.batch_invariant = batch_invariant
        if batch_invariant:  # torch's int4 kernel too: its rows are the same in any batch
            self.amx_bf16_min_rows = self.dense_min_rows = 1 << 62

    def group_size_for(self, sources: list[WeightSource]) -> int:
        """32 when any partition comes as GGUF 4-bit blocks (kept exact), else the default."""
        exact = any(isinstance(s, GGUFBlockWeight) and s.qtype in _GGUF_INT4 for s in sources)
        return BLOCK if exact else self.group_size

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        group = self.group_size_for(sources)
        parts = [
            s.int4_groups() if isinstance(s, GGUFBlockWeight) and s.qtype in _GGUF_INT4
            else quantize_groups_int4(dense(s), group)
            for s in sources
        ]
        codes = torch.cat([c for c, _, _ in parts])
        scale = torch.cat([s for _, s, _ in parts])  # [N, K/g]
        zero = torch.cat([z for _, _, z in parts])
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [K/g, N, 2]
        layer.register_buffer("weight", packed.to(device))
        layer.register_buffer("scale_zero", scale_zero.to(device=device, dtype=torch.bfloat16))
        layer.group_size = group
        layer.block_n = _blocked_layout(packed, codes)
        layer.amx = layer.block_n == 64 and device.type == "cpu" and amx.available()
        layer.int4_matmul = self._matmul(layer)
        if layer.block_n is None:
            # the portable copy: byte j of a row holds columns 2j (low nibble) and 2j+1 (high)
            nibbles = codes[:, 0::2] | (codes[:, 1::2] << 4)
            layer.register_buffer("nibbles", nibbles.contiguous().to(device))

    def _matmul(self, layer: nn.Module):
        """The layer's x -> x @ W.T (bf16 out; float32 through the dense path), choosing the
        kernel by row count."""
        op, w, group, sz = (torch._weight_int4pack_mm_for_cpu, layer.weight, layer.group_size,
                            layer.scale_zero)
        if layer.amx:
            matmul, bf16_rows = amx.q4_matmul, self.amx_bf16_min_rows
            return lambda x: matmul(x, w, sz, group, "codes" if x.shape[0] < bf16_rows else "bf16")
        dense_rows = self.dense_min_rows

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= dense_rows:
                return dense_forward(x, self.dequantize(layer))
            return op(x, w, group, sz)
        return matmul

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.int4_matmul(x)

    def decode_fn(self, layer: nn.Module):
        return with_bias(layer.int4_matmul, layer.bias, torch.bfloat16)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if layer.block_n is not None:
            codes = _unpack_blocked(layer.weight, layer.block_n)
        else:
            codes = torch.stack([layer.nibbles & 15, layer.nibbles >> 4], dim=-1)
        n = layer.weight.shape[0]
        # the kernel's own bf16 (scale, zero), widened here rather than kept as fp32 copies
        # (+0.25 byte per weight for a prefill-only convenience)
        used = layer.scale_zero.float().permute(1, 0, 2).contiguous()  # [N, K/g, 2]
        groups = used.shape[1]
        codes = codes.reshape(n, groups, -1)
        w = torch.addcmul(used[..., 1:2], codes.float() - 8, used[..., 0:1])
        return w.view(n, -1)

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(b.numel() * b.element_size() for name, b in layer.named_buffers(recurse=False)
                   if name in ("weight", "scale_zero", "nibbles"))

    def decode_bytes(self, layer: nn.Module) -> int:
        return layer.weight.numel() + layer.scale_zero.numel() * 2  # not the prefill copy

    def __repr__(self) -> str:
        return (f"Int4Method(group_size={self.group_size}"
                f"{', batch_invariant=True' if self.batch_invariant else ''})")
