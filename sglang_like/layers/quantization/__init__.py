"""Weight quantization: the linear-method seam and the methods behind `--quantization`.

`none` keeps dense weights in the model dtype (the exact fp32 path on CPU, bf16 on CUDA);
`int8` is weight-only int8 per output row; `int4` is weight-only int4 per group of 32/64
input columns; `fp16` keeps every matrix in fp16 for fbgemm's GEMM (fp32 activations). All
keep fp32 logits from a head of block-int8 rows (the native Q8_0 kernel; fbgemm fp16 where
that kernel is not built) whose rows the embedding gathers.
GGUF Q4_0/Q4_1/Q8_0 matrices are repacked from their blocks, never held as fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_like.config import QUANTIZATION_CHOICES
from sglang_like.layers.quantization.base import LinearMethod, WeightSource, dense
from sglang_like.layers.quantization.dense import DenseMethod
from sglang_like.layers.quantization.fp16_fbgemm import Fp16FbgemmMethod, fbgemm_fp16_available
from sglang_like.layers.quantization.gguf_blocks import (
    PACKED_QTYPES,
    GGUFBlockWeight,
    all_int4_blocks,
    any_gguf_blocks,
)
from sglang_like.layers.quantization.gguf_native import (
    GGUFHeadMethod,
    GGUFMethod,
    GGUFNativeMethod,
    GGUFRowsMethod,
    Q8ExpertMethod,
)
from sglang_like.layers.quantization.int4 import Int4Method, quantize_groups_int4
from sglang_like.layers.quantization.int8 import (
    Int8EmbeddingMethod,
    Int8Method,
    quantize_blocks_int8,
    quantize_rows_int8,
)
from sglang_like.layers.quantization.linear import QuantLinear
from sglang_like.layers.quantization.q4_native import (
    Q4NativeMethod,
    Q4X16Method,
    int4_kernel,
    q4_1_blocks,
)
from sglang_like.layers.quantization.q8_head import Q8HeadMethod, q8_head_available
from sglang_like_kernels.cpu import available as native_cpu_available

__all__ = [
    "PACKED_QTYPES",
    "QUANTIZATION_CHOICES",
    "DenseMethod",
    "Fp16FbgemmMethod",
    "GGUFBlockWeight",
    "GGUFHeadMethod",
    "GGUFMethod",
    "GGUFRowsMethod",
    "Q8ExpertMethod",
    "GGUFNativeMethod",
    "Int4Method",
    "Int8EmbeddingMethod",
    "Int8Method",
    "LinearMethod",
    "Q4NativeMethod",
    "Q4X16Method",
    "Q8HeadMethod",
    "int4_kernel",
    "q8_head_available",
    "QuantConfig",
    "QuantLinear",
    "WeightSource",
    "all_int4_blocks",
    "any_gguf_blocks",
    "dense",
    "fbgemm_fp16_available",
    "quantize_blocks_int8",
    "quantize_groups_int4",
    "quantize_rows_int8",
    "q4_1_blocks",
    "resolve_quantization",
]



def resolve_quantization(
    quantization: str, *, device: torch.device, dtype_is_explicit: bool,
    source_has_int4_blocks: bool, source_has_gguf_blocks: bool = False,
) -> str:
    """`auto` -> a concrete method; a choice the device cannot run is a ValueError.

    On CPU, `auto` is int4 when the checkpoint is a GGUF whose matrices are Q4_0/Q4_1 (they
    repack code for code: the same weights, a third of int8's bytes), `gguf` when it holds
    other GGUF block types (Q4_K_M, Q6_K, Q8_0 files...: each matrix on the kernel of its
    own type, gguf_native), and int8 otherwise;
    an explicit `--dtype` means the user asked for dense weights, so `auto` is `none` then.
    `fp16` (asked for) keeps every matrix in fp16 for fbgemm. Its time grows less with rows
    than the int kernels', which speculative verify passes like, but a 1-row step reads twice
    int4's bytes, which costs more than the verifies gain at batch 1; so `auto` keeps int4
    with speculation on too (and turning speculation on never changes the weights outputs
    come from). Measurements: docs/cpu-kernels.md.
    On CUDA `auto` is `none` (bf16): the int kernels here are CPU kernels.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; "
                         f"got {quantization!r}")
    if device.type != "cpu":
        if quantization in ("int8", "int4", "fp16", "gguf"):
            raise ValueError(f"quantization {quantization!r} runs on CPU only (device {device})")
        return "none"
    if quantization == "gguf" and not source_has_gguf_blocks:
        raise ValueError("quantization 'gguf' keeps a GGUF file's blocks; this checkpoint's "
                         "transformer matrices are not GGUF blocks")
    if quantization == "gguf" and not native_cpu_available():
        raise ValueError("quantization 'gguf' needs the native CPU kernels (an x86 CPU with "
                         "AVX2 and a C compiler)")
    if quantization != "auto":
        return quantization
    if quantization == "fp16" and not fbgemm_fp16_available():
        raise ValueError("quantization 'fp16' needs fbgemm's fp16 GEMM (an x86 CPU with AVX2)")
    if dtype_is_explicit:
        return "none"
    if source_has_int4_blocks:
        return "int4"
    return "gguf" if source_has_gguf_blocks and native_cpu_available() else "int8"


@dataclass(frozen=True)
class QuantConfig:
    """The methods a model's linears use, built once from the resolved `--quantization`."""

    name: str  # "none" | "int8" | "int4" | "fp16" | "gguf"
    dtype: torch.dtype  # dense dtype: unquantized weights and the `none` path's activations
    # one int4 kernel and one head kernel at every row count (`--enable-deterministic-inference`)
    deterministic: bool = False

    @property
    def is_quantized(self) -> bool:
        return self.name != "none"

    def linear_method(self, in_features: int, out_features: int) -> LinearMethod:
        """The method of a transformer-block linear of that shape (the int4 packer wants
        out_features % 16 == 0 and groups that divide in_features; else int8)."""
        if self.name == "fp16":
            return _FP16
        if self.name == "gguf":
            return _GGUF
        kernel = int4_kernel() if self.name == "int4" and in_features % 32 == 0 else None
        if kernel == "x16" and out_features % 16 == 0:
            return _Q4_X16[self.deterministic]  # see q4_native
        if kernel in ("x16", "native"):
            return _Q4_NATIVE[self.deterministic]
        if self.name == "int4" and in_features % 32 == 0 and out_features % 16 == 0:
            group = 64 if in_features % 64 == 0 else 32
            return _INT4_METHODS[group, self.deterministic]
        if self.name in ("int4", "int8"):
            return _INT8
        return DenseMethod(self.dtype)

    def expert_method(self, in_features: int, out_features: int) -> LinearMethod:
        """The method of a sparse layer's expert linear: `int8` experts on the native Q8_0
        kind (Q8ExpertMethod: moe.c runs them in one call a layer) where the kernels are
        built and the shape fits; else as any linear of that shape."""
        if (self.name == "int8" and in_features % 32 == 0 and out_features % 16 == 0
                and native_cpu_available()):
            return _Q8_EXPERT
        return self.linear_method(in_features, out_features)

    def head_method(self, in_features: int, *, embeds: bool = True) -> LinearMethod:
        """The method of the LM head; `embeds`: it is also the (tied) embedding.

        Quantized models keep logits in fp32: block-int8 rows through the native Q8_0 kernel
        (one copy a quarter of fp32's bytes; see q8_head: on AVX-512 VNNI the x16 layout,
        whose AMX tile kernel gives the same logits from 8 rows, AMX CPUs included), else
        fbgemm's fp16 GEMM where the CPU has it, else int8 (whose bf16 output is cast up).
        Under `gguf` a head of a K / legacy / IQ4 type other than Q8_0 stays in the file's
        codes on its own kernel (GGUFHeadMethod).
        """
        if not self.is_quantized:
            return DenseMethod(self.dtype)
        if in_features % 32 == 0 and q8_head_available():
            if self.name == "gguf":  # a head in the file's own type where that is not Q8_0
                return _GGUF_HEADS[self.deterministic]
            return _Q8_HEADS[self.deterministic]
        if fbgemm_fp16_available():
            return _FP16_TIED if embeds else _FP16
        return _INT8

    def embedding_method(self) -> LinearMethod:
        """The method of an untied embedding (rows gathered, never multiplied): under `gguf`
        in the file's own type where kquants.c holds it (GGUFHeadMethod), else int8 rows."""
        if self.name == "gguf":
            return _GGUF_EMBED
        return _INT8_EMBED if self.is_quantized else DenseMethod(self.dtype)

    @property
    def activation_dtype(self) -> torch.dtype:
        if self.name in ("fp16", "gguf"):
            # fbgemm's fp16 GEMM takes and returns fp32; the GGUF kernels round fp32 to int8
            return torch.float32
        if self.name == "int4" and int4_kernel() != "torch":
            # this project's Q4_1 kernels take fp32 and round it to int8 per 32 columns: a
            # bf16 rounding before that would be a second one, which the native decode path
            # (norms straight into the kernel) does not do
            return torch.float32
        return torch.bfloat16 if self.is_quantized else self.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype under `--kv-cache-dtype auto`: the dtype K and V come out of
        their projection in, but bf16 for every int kernel (an fp32 pool would double the KV
        memory for a rounding that is lost in attention's noise; llama.cpp keeps f16 KV)."""
        if not self.is_quantized:
            return self.dtype
        return torch.float32 if self.name == "fp16" else torch.bfloat16


_INT8 = Int8Method()
_INT8_EMBED = Int8EmbeddingMethod()
_FP16 = Fp16FbgemmMethod(embed_rows=False)
_FP16_TIED = Fp16FbgemmMethod(embed_rows=True)
_Q8_HEADS = {det: Q8HeadMethod(batch_invariant=det) for det in (False, True)}
_INT4_METHODS = {(g, det): Int4Method(g, batch_invariant=det) for g in (32, 64)
                 for det in (False, True)}
_Q4_NATIVE = {det: Q4NativeMethod(batch_invariant=det) for det in (False, True)}
_Q4_X16 = {det: Q4X16Method(batch_invariant=det) for det in (False, True)}
_GGUF = GGUFMethod()
_GGUF_HEADS = {det: GGUFHeadMethod(_Q8_HEADS[det]) for det in (False, True)}
_GGUF_EMBED = GGUFHeadMethod(_INT8_EMBED, reads_all=False)
_Q8_EXPERT = Q8ExpertMethod()
