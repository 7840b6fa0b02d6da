"""GGUF block-quantized matrices kept packed: the file's blocks, held until a linear method
repacks them (Q4_0 / Q4_1 / Q8_0 decoded here to codes + scales; the other types in
gguf_native)."""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
import torch

# Each block covers 32 weights of one row. Byte layout per block:
#   Q4_0: d f16 | 16 bytes of nibbles            w = d * (q - 8)
#   Q4_1: d f16 | m f16 | 16 bytes of nibbles     w = d * q + m
#   Q8_0: d f16 | 32 int8                         w = d * q
# A nibble byte j holds weight j in its low half and weight j + 16 in its high half.
BLOCK = 32
# the types a loader keeps packed: those a kernel multiplies in their own codes
PACKED_QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL",
                 "IQ4_XS")


class GGUFBlockWeight(NamedTuple):
    """One [out, in] matrix as the GGUF file stores it: `blocks` uint8 [out, bytes per row]."""

    qtype: str  # one of PACKED_QTYPES
    shape: tuple[int, int]
    blocks: np.ndarray

    @property
    def dtype(self) -> torch.dtype:  # what it dequantizes to
        return torch.float32

    def _view(self, block_bytes: int) -> np.ndarray:
        rows, cols = self.shape
        return np.asarray(self.blocks).reshape(rows, cols // BLOCK, block_bytes)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (as gguf's reference dequantizer gives it)."""
        qtype = gguf.GGMLQuantizationType[self.qtype]
        values = gguf.quants.dequantize(np.asarray(self.blocks), qtype)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(self.shape))

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q4_0/Q4_1 as (codes uint8 [out, in] in 0..15, scale, zero fp32 [out, in/32]) with
        w = (code - 8) * scale + zero, which is exactly the file's value."""
        if self.qtype not in ("Q4_0", "Q4_1"):
            raise ValueError(f"{self.qtype} has no 4-bit codes")
        head = 2 if self.qtype == "Q4_0" else 4
        view = self._view(head + BLOCK // 2)
        d = view[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = view[..., head:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, nb, 32]
        codes = codes.reshape(self.shape)
        if self.qtype == "Q4_0":
            zero = np.zeros_like(d)
        else:
            m = view[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zero = m + 8.0 * d
        return torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(zero)

    def int8_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Q8_0 as (codes int8 [out, in], d fp32 [out, in/32]) with w = code * d."""
        if self.qtype != "Q8_0":
            raise ValueError(f"{self.qtype} has no 8-bit codes")
        view = self._view(2 + BLOCK)
        d = view[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = view[..., 2:].copy().view(np.int8).reshape(self.shape)
        return torch.from_numpy(codes), torch.from_numpy(d)

    def take_rows(self, index: torch.Tensor) -> GGUFBlockWeight:
        """The rows `index` names, in its order (a permutation or a subset: blocks stay whole)."""
        blocks = np.ascontiguousarray(np.asarray(self.blocks)[index.numpy()])
        return self._replace(shape=(len(index), self.shape[1]), blocks=blocks)

    def slice_rows(self, start: int, stop: int) -> GGUFBlockWeight:
        """Rows [start, stop) (a column-parallel shard): whole rows of blocks, no decoding."""
        rows, cols = self.shape
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"rows [{start}, {stop}) outside a matrix of {rows} rows")
        blocks = np.ascontiguousarray(np.asarray(self.blocks).reshape(rows, -1)[start:stop])
        return self._replace(shape=(stop - start, cols), blocks=blocks)

    @property
    def block_size(self) -> int:
        """Columns per block: 32, or 256 for the K types' super-blocks."""
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]][0]

    def dequantize_rows(self, chunk: int = 4096):
        """(start, float32 rows [start, start + chunk)) over the matrix: the whole matrix
        never exists in fp32 at once."""
        rows = self.shape[0]
        for start in range(0, rows, chunk):
            yield start, self.slice_rows(start, min(rows, start + chunk)).dequantize()

    def slice_cols(self, start: int, stop: int) -> GGUFBlockWeight:
        """Columns [start, stop) (a row-parallel shard); both ends on a block boundary (32
        columns, 256 for K types), so every block is kept whole and its scale stays exact."""
        rows, cols = self.shape
        bs = self.block_size
        if not 0 <= start <= stop <= cols or start % bs or stop % bs:
            raise ValueError(f"columns [{start}, {stop}) of {cols} are not on {bs}-column "
                             f"block boundaries ({self.qtype})")
        block_bytes = np.asarray(self.blocks).size // (rows * (cols // bs))
        view = np.asarray(self.blocks).reshape(rows, cols // bs, block_bytes)
        blocks = np.ascontiguousarray(view[:, start // bs : stop // bs])
        return self._replace(shape=(rows, stop - start), blocks=blocks.reshape(rows, -1))


def layer_matrices(weights: dict[str, object]) -> list[object]:
    return [w for name, w in weights.items() if name.startswith("model.layers.")
            and len(w.shape) == 2]


def any_gguf_blocks(weights: dict[str, object]) -> bool:
    """Whether a transformer-block matrix of loaded weights is a GGUF block matrix."""
    return any(isinstance(w, GGUFBlockWeight) for w in layer_matrices(weights))


def all_int4_blocks(weights: dict[str, object]) -> bool:
    """Whether every transformer-block matrix of loaded weights is a GGUF Q4_0/Q4_1 block
    matrix (int4 then repacks the file's own codes)."""
    matrices = layer_matrices(weights)
    return bool(matrices) and all(isinstance(w, GGUFBlockWeight) and w.qtype in ("Q4_0", "Q4_1")
                                  for w in matrices)
