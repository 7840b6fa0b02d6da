"""Weight-only int8, one scale per output row: torch's `_weight_int8pack_mm` (bf16 input)."""

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
from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes int8 [N, K], scale fp32 [N]) with w ~ code * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


EMBED_BLOCK = 32


def quantize_blocks_int8(source: WeightSource) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per 32 columns: (codes int8 [N, K], scale fp32 [N, K/32]). A GGUF Q8_0
    matrix is taken as it is (exact); K not a multiple of 32 gets one block per row."""
    if isinstance(source, GGUFBlockWeight) and source.qtype == "Q8_0":
        return source.int8_blocks()
    if isinstance(source, GGUFBlockWeight):  # other types: a chunk of rows at a time
        parts = [quantize_blocks_int8(rows) for _, rows in source.dequantize_rows()]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    w = dense(source)
    n, k = w.shape
    block = EMBED_BLOCK if k % EMBED_BLOCK == 0 else k
    blocks = w.reshape(n, k // block, block)
    scale = (blocks.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    codes = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


def embed_block_rows(codes: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a block-int8 matrix as float32 [T, K]."""
    rows = codes[ids].float()
    t, k = rows.shape
    blocks = scale.shape[1]
    return (rows.view(t, blocks, k // blocks) * scale[ids].unsqueeze(-1)).view(t, k)


class Int8EmbeddingMethod(LinearMethod):
    """An embedding gathered from int8 rows with a scale per 32 columns (GGUF Q8_0 exactly);
    it multiplies only for tests (`apply` dequantizes: never on a hot path)."""

    input_dtype = torch.float32

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        if len(sources) != 1:
            raise ValueError("an embedding has one partition")
        codes, scale = quantize_blocks_int8(sources[0])
        layer.register_buffer("weight", codes.to(device))
        layer.register_buffer("block_scale", scale.to(device))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize(layer).T

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        ids = torch.arange(layer.weight.shape[0], device=layer.weight.device)
        return embed_block_rows(layer.weight, layer.block_scale, ids)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return embed_block_rows(layer.weight, layer.block_scale, ids)

    def decode_bytes(self, layer: nn.Module) -> int:
        return 0  # a step gathers only a few rows


def _row_chunks(source: WeightSource):
    """The source's float32 rows, a chunk at a time for a GGUF matrix (never whole in fp32)."""
    if isinstance(source, GGUFBlockWeight):
        for _, rows in source.dequantize_rows():
            yield rows
    else:
        yield dense(source)


class Int8Method(LinearMethod):
    """int8 codes [N, K] with a bf16 scale per row; activations in bf16 (the vectorized path
    of the CPU kernel). GGUF Q8_0 blocks are re-scaled per row (its 32-wide blocks have no
    matching kernel); every other source is quantized at load. Forwards of `dense_min_rows`
    rows or more (prefill) dequantize into fp32 and run the GEMM, like int4 (see there)."""

    input_dtype = torch.bfloat16
    dense_min_rows = 256

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        parts = [quantize_rows_int8(rows) for s in sources for rows in _row_chunks(s)]
        codes = torch.cat([c for c, _ in parts]).contiguous()
        scale = torch.cat([s for _, s in parts])
        layer.register_buffer("weight", codes.to(device))
        layer.register_buffer("scale", scale.to(device=device, dtype=torch.bfloat16))
        # the embedding path rescales in fp32 from the same bf16 scale the matmul uses
        layer.register_buffer("scale_f32", layer.scale.float(), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_min_rows:
            return dense_forward(x, self.dequantize(layer))
        return torch._weight_int8pack_mm(x, layer.weight, layer.scale)

    def decode_fn(self, layer: nn.Module):
        op, w, scale = torch._weight_int8pack_mm, layer.weight, layer.scale
        return with_bias(lambda x: op(x, w, scale), layer.bias, torch.bfloat16)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.scale_f32[:, None]

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids].float() * layer.scale_f32[ids].unsqueeze(-1)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.weight.numel() + layer.scale.numel() * 2
