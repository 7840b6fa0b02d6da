"""GGUF matrices of the types people download, multiplied in their own codes.

A file whose every matrix is Q4_0 / Q4_1 runs on the x16 Q4_1 kernel (q4_native, `int4`).
The types a Q4_K_M / Q5_K_M / Q6_K / Q8_0 / IQ4 file holds (`gguf`) run here, on kquants.c
(Q4_0 / Q4_1 blocks of such a file too, as the same numbers): each type's blocks are read
into codes and a scale per row and block of 32 columns (16 for Q6_K), plus a min (Q4_K,
Q5_K, Q5_1) or a fixed offset (the rest), and repacked 16 rows at a time.

The codes are the file's. The K types' two-level scales (a 6-bit sub-block scale times the
super-block's fp16) are folded into one fp16 per block, which rounds them by at most 2^-11
relative. Bits per weight: Q5_0 5.5, IQ4_NL / IQ4_XS 4.5, Q8_0 8.5 (as the file); Q4_K 5
(file 4.5), Q5_K and Q5_1 6 (file 5.5 and 6), Q6_K 7 (file 6.56).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from sglang_like.layers.quantization.base import LinearMethod, WeightSource, with_bias
from sglang_like.layers.quantization.gguf_blocks import BLOCK, GGUFBlockWeight
from sglang_like_kernels import cpu as native_cpu
from sglang_like_kernels.cpu import amx

logger = logging.getLogger(__name__)

# GGUF type -> kquants.c kind
KQ_KIND = {"Q4_0": "q4m", "Q4_1": "q4m", "Q4_K": "q4m", "Q5_K": "q5m", "Q5_1": "q5m",
           "Q5_0": "q5o", "Q6_K": "q6", "Q8_0": "q8", "IQ4_NL": "iq4", "IQ4_XS": "iq4"}
_BITS = {"q4m": 4, "iq4": 4, "q5o": 5, "q5m": 5, "q6": 6, "q8": 8}
OFFSET = {"iq4": 128, "q5o": 16, "q6": 32, "q8": 128}  # w = d * (code - offset); others 0
_ROWS = 16
# ggml's kvalues_iq4nl: the 16 values an IQ4 nibble stands for
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                       113], dtype=np.int16)


def _f16(view: np.ndarray, at: int) -> np.ndarray:
    return view[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 6-bit (scale, min) of the 8 sub-blocks, [..., 8] each."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: byte j holds code j low and code j + 16 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def block_codes(w: GGUFBlockWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes uint8 [N, K], d float32 [N, K/32] (Q6_K: [N, K/16]), m float32 [N, K/32] or
    None) with the file's values w = d * code + m, or d * (code - offset) for the offset
    kinds (IQ4: code = table value + 128; Q8_0: code = q + 128)."""
    rows, cols = w.shape
    raw = np.asarray(w.blocks).reshape(rows, -1)
    qt = w.qtype
    if qt in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS") and cols % 256:
        raise ValueError(f"{qt} needs rows of a multiple of 256 columns; got {cols}")
    if qt in ("Q4_0", "Q4_1"):
        head = 2 if qt == "Q4_0" else 4
        v = raw.reshape(rows, cols // 32, head + 16)
        d = _f16(v, 0)
        m = _f16(v, 2) if qt == "Q4_1" else -8.0 * d  # Q4_0: d * (q - 8), exact in fp16
        return _nibbles32(v[..., head:]).reshape(rows, cols), d, m
    if qt == "Q5_0" or qt == "Q5_1":
        head = 2 if qt == "Q5_0" else 4
        v = raw.reshape(rows, cols // 32, head + 20)
        d = _f16(v, 0)
        qh = v[..., head:head + 4].copy().view(np.uint32)[..., 0]
        hi = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = _nibbles32(v[..., head + 4:]) | (hi << 4)
        m = _f16(v, 2) if qt == "Q5_1" else None
        return codes.reshape(rows, cols), d, m
    if qt == "Q8_0":
        v = raw.reshape(rows, cols // 32, 34)
        codes = (v[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(rows, cols), _f16(v, 0), None
    if qt == "IQ4_NL":
        v = raw.reshape(rows, cols // 32, 18)
        codes = (IQ4_VALUES[_nibbles32(v[..., 2:])] + 128).astype(np.uint8)
        return codes.reshape(rows, cols), _f16(v, 0), None
    if qt == "IQ4_XS":
        v = raw.reshape(rows, cols // 256, 136)
        d = _f16(v, 0)
        sh = v[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int32)
        sl = v[..., 4:8].astype(np.int32)
        ib = np.arange(8)
        ls = ((sl[..., ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh[..., None] >> (2 * ib)) & 3) << 4)
        dl = d[..., None] * (ls - 32).astype(np.float32)  # [rows, nsb, 8]
        qs = v[..., 8:].reshape(rows, cols // 256, 8, 16)
        codes = (IQ4_VALUES[_nibbles32(qs)] + 128).astype(np.uint8)
        return codes.reshape(rows, cols), dl.reshape(rows, -1), None
    if qt in ("Q4_K", "Q5_K"):
        size = 144 if qt == "Q4_K" else 176
        v = raw.reshape(rows, cols // 256, size)
        d, dmin = _f16(v, 0), _f16(v, 2)
        sc, mn = _k_scale_min(v[..., 4:16])
        qs = v[..., size - 128:].reshape(rows, cols // 256, 4, 32)
        # chunk i of 64: sub-block 2i from the low nibbles, 2i + 1 from the high
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, nsb, 4, 2, 32]
        if qt == "Q5_K":
            qh = v[..., 16:48]  # [rows, nsb, 32]: bit j of byte l -> sub-block j, code l
            bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = codes | (bits.reshape(rows, cols // 256, 4, 2, 32) << 4)
        dd = d[..., None] * sc
        mm = -(dmin[..., None] * mn)
        return (codes.reshape(rows, cols), dd.reshape(rows, -1), mm.reshape(rows, -1))
    if qt == "Q6_K":
        v = raw.reshape(rows, cols // 256, 210)
        ql = v[..., 0:128].reshape(rows, -1, 2, 64)
        qh = v[..., 128:192].reshape(rows, -1, 2, 32)
        sc = v[..., 192:208].view(np.int8).astype(np.float32)  # [rows, nsb, 16]
        d = _f16(v, 208)
        q1 = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
        q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
        q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
        codes = np.stack([q1, q2, q3, q4], axis=3)  # [rows, nsb, 2, 4, 32]
        return codes.reshape(rows, cols), (d[..., None] * sc).reshape(rows, -1), None
    raise ValueError(f"no native kernel for GGUF type {qt}")


def _fp16_checked(x: np.ndarray, name: str) -> np.ndarray:
    out = x.astype(np.float16)
    if not np.isfinite(out).all():
        raise ValueError(f"{name}: a block scale overflows fp16")
    return out


# rows repacked at a time: numpy's temporaries for a chunk are a few times its codes' bytes,
# which for a whole 49152 x 2048 head or embedding raised the load's peak RSS by ~370 MB
_PACK_ROWS = 1024


def pack(w: GGUFBlockWeight) -> tuple[str, torch.Tensor]:
    """(kind, the matrix in kquants.c's layout uint8 [N/16, K/32 * record bytes])."""
    kind = KQ_KIND[w.qtype]
    rows, cols = w.shape
    if rows % _ROWS or cols % BLOCK:
        raise ValueError(f"{w.qtype} [{rows}, {cols}]: kquants.c needs rows % 16 and cols % 32")
    if rows <= _PACK_ROWS:
        return kind, torch.from_numpy(_pack_rows(w, kind, f"{w.qtype} [{rows}, {cols}]"))
    raw = np.asarray(w.blocks).reshape(rows, -1)
    out = np.empty((rows // _ROWS, cols // BLOCK * native_cpu.kq_record_bytes(kind)), np.uint8)
    for r in range(0, rows, _PACK_ROWS):
        n = min(_PACK_ROWS, rows - r)
        part = GGUFBlockWeight(w.qtype, (n, cols), raw[r:r + n])
        out[r // _ROWS:(r + n) // _ROWS] = _pack_rows(part, kind, f"{w.qtype} [{rows}, {cols}]")
    return kind, torch.from_numpy(out)


def _pack_rows(w: GGUFBlockWeight, kind: str, name: str) -> np.ndarray:
    rows, cols = w.shape
    codes, d, m = block_codes(w)
    g, nb = rows // _ROWS, cols // BLOCK
    c = codes.reshape(g, _ROWS, nb, 8, 4)  # [group, row, block, t, j]: column 4t + j
    parts = []
    if _BITS[kind] == 8:
        parts.append(c.transpose(0, 2, 3, 1, 4).reshape(g, nb, 512))
    else:
        nib = (c[:, :, :, :4] & 0x0F) | ((c[:, :, :, 4:] & 0x0F) << 4)
        if kind == "iq4":  # IQ4's nibble is the table index, not the value
            idx = np.searchsorted(IQ4_VALUES + 128, c)
            nib = (idx[:, :, :, :4] | (idx[:, :, :, 4:] << 4)).astype(np.uint8)
        parts.append(nib.transpose(0, 2, 3, 1, 4).reshape(g, nb, 256))
        for p in range(_BITS[kind] - 4):
            bit = (c >> (4 + p)) & 1  # [g, r, b, t, j]
            plane = (bit << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=3, dtype=np.uint8)
            parts.append(plane.transpose(0, 2, 1, 3).reshape(g, nb, 64))
    if kind == "q6":  # d per 16 columns: first halves, then second halves
        d16 = _fp16_checked(d, name).reshape(g, _ROWS, nb, 2)
        scales = [d16[..., 0], d16[..., 1]]
    else:
        scales = [_fp16_checked(d, name).reshape(g, _ROWS, nb)]
        if m is not None:
            scales.append(_fp16_checked(m, name).reshape(g, _ROWS, nb))
    for s in scales:
        parts.append(np.ascontiguousarray(s.transpose(0, 2, 1)).view(np.uint8))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(g, -1))


class GGUFNativeMethod(LinearMethod):
    """A linear whose partitions are GGUF matrices of types in `KQ_KIND`, packed for
    kquants.c; float32 activations in and out. Every row count runs the kernel, so a row's
    result is the same bits alone, in a batch, in a verify or in a prefill of any length
    (batch- and cache-invariant linears by default). A prefill does not dequantize the layer
    for a GEMM: on the default model requantized to Q4_K_M a 1k-token prefill ran at about
    the same speed either way on an AMX Xeon (the GEMM's speed spent on dequantizing every
    layer each forward), and the kernel keeps a 1B model from ever existing in fp32. Fused
    partitions (qkv, gate_up) of different types, which a K-quant mix can give, run one call
    per run of equal kinds.

    With AMX, forwards of `amx_min_rows` rows or more (Q6_K: twice that, its halves of 16
    columns take two tile products) run amx_kq.c on the same bytes: the same bits as the
    vector kernel, 1.4-2.6x its speed from 64 rows on a 2-core Xeon (docs/cpu-kernels.md)."""

    input_dtype = torch.float32
    amx_min_rows = 32

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"{type(self).__name__} runs on CPU only")
        runs: list[tuple[str, int, int]] = []  # (kind, rows, cols) per packed run
        buffers = []
        for s in sources:
            if not isinstance(s, GGUFBlockWeight) or s.qtype not in KQ_KIND:
                raise ValueError(f"{type(self).__name__} takes GGUF {', '.join(KQ_KIND)} "
                                 f"matrices; got {getattr(s, 'qtype', type(s).__name__)}")
            kind, packed = pack(s)
            if runs and runs[-1][0] == kind:  # same kernel: one call for both
                runs[-1] = (kind, runs[-1][1] + s.shape[0], s.shape[1])
                buffers[-1] = torch.cat([buffers[-1], packed])
            else:
                runs.append((kind, s.shape[0], s.shape[1]))
                buffers.append(packed)
        layer.kq_runs = runs
        for i, b in enumerate(buffers):
            layer.register_buffer(f"kq{i}", b.contiguous())

    def packed_runs(self, layer: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, rows, packed weight) per run of the layer, in output order."""
        return [(kind, n, getattr(layer, f"kq{i}"))
                for i, (kind, n, _) in enumerate(layer.kq_runs)]

    def _matmul(self, layer: nn.Module):
        """x -> x @ W.T over the layer's runs (no bias)."""
        runs = [(self._kernel(kind), n, p) for kind, n, p in self.packed_runs(layer)]
        if len(runs) == 1:
            kernel, n, packed = runs[0]
            return lambda x: kernel(x, packed, n)
        return lambda x: torch.cat([kernel(x, p, n) for kernel, n, p in runs], dim=1)

    def _kernel(self, kind: str):
        """(x, packed, n) -> x @ W.T for one run: the vector kernel, or from `amx_min_rows`
        rows the tiles (the same bits, so the switch changes no result)."""
        vector = native_cpu.kq_matmul
        if not amx.available():
            return lambda x, packed, n: vector(x, packed, kind, n)
        code = native_cpu.KQ_KINDS[kind]
        min_rows = self.amx_min_rows * (2 if kind == "q6" else 1)
        return lambda x, packed, n: (amx.kq_matmul(x, packed, code, n) if x.shape[0] >= min_rows
                                     else vector(x, packed, kind, n))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(layer)(x)  # QuantLinear adds the bias

    def decode_fn(self, layer: nn.Module):
        return with_bias(self._matmul(layer), layer.bias, torch.float32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return torch.cat([native_cpu.kq_dequantize(p, kind, n, layer.in_features)
                          for kind, n, p in self.packed_runs(layer)])

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(p.numel() for _, _, p in self.packed_runs(layer))



class GGUFRowsMethod(GGUFNativeMethod):
    """GGUFNativeMethod whose rows can also be gathered (`embed`, kq_rows: the values the
    kernel multiplies): an LM head, a tied embedding, or (`reads_all=False`) an untied
    embedding, of which a step reads only its tokens' rows."""

    def __init__(self, reads_all: bool = True) -> None:
        self.reads_all = reads_all

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        (kind, n, packed), = self.packed_runs(layer)  # one partition: one run
        return native_cpu.kq_rows(packed, kind, n, layer.in_features, ids)

    def decode_bytes(self, layer: nn.Module) -> int:
        return self.weight_bytes(layer) if self.reads_all else 0


class _ChosenPerLayer(LinearMethod):
    """A method that picks another per layer when the weights arrive (`layer.gguf_method`)
    and answers for it."""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.gguf_method.dequantize(layer)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.gguf_method.weight_bytes(layer)

    def decode_bytes(self, layer: nn.Module) -> int:
        return layer.gguf_method.decode_bytes(layer)


class GGUFHeadMethod(_ChosenPerLayer):
    """`gguf`'s LM head and embeddings. A matrix of a type in `KQ_KIND` other than Q8_0 stays
    in the file's codes (GGUFRowsMethod): the head's logits come from kquants.c, activations
    rounded to int8 as llama.cpp rounds them for its dot; the embedding's rows are gathered out
    of the same bytes. Requantizing it to `fallback`'s int8 rows instead rounded the file's
    values a second time into more bytes: a Q6_K head is 7 bits a weight here (6.56 in the
    file), 9 as int8 rows with float32 scales; a Q4_K embedding 5 against 9.
    A Q8_0 matrix (already those int8 rows, exactly), a dense one, or a shape kquants.c cannot
    pack takes `fallback` (the Q8_0 head, or the int8 embedding). The method the layer took is
    `layer.gguf_method`."""

    input_dtype = torch.float32

    def __init__(self, fallback: LinearMethod, reads_all: bool = True) -> None:
        self.fallback = fallback
        self._native = GGUFRowsMethod(reads_all)

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        s = sources[0] if len(sources) == 1 else None
        native = (isinstance(s, GGUFBlockWeight) and s.qtype in KQ_KIND and s.qtype != "Q8_0"
                  and s.shape[0] % _ROWS == 0 and s.shape[1] % BLOCK == 0
                  and device.type == "cpu")
        layer.gguf_method = self._native if native else self.fallback
        layer.gguf_method.create_weights(layer, sources, device)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.gguf_method.apply(layer, x)

    def decode_fn(self, layer: nn.Module):
        return layer.gguf_method.decode_fn(layer)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.gguf_method.embed(layer, ids)

    def argmax_supported(self, layer: nn.Module) -> bool:
        supported = getattr(layer.gguf_method, "argmax_supported", None)
        return supported is not None and supported(layer)

    def argmax(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.gguf_method.argmax(layer, x)


class Q8ExpertMethod(GGUFNativeMethod):
    """`--quantization int8`'s experts of a sparse layer: each matrix rounded to int8 per row
    and block of 32 columns with an fp16 scale (GGUF's Q8_0, gguf-py's rounding; a Q8_0
    matrix is taken as it is) and run on kquants.c's Q8_0 kind, so moe.c and the one-call
    step run them as they run a GGUF file's, instead of an int8 expert at a time in torch.
    The other int8 linears keep one scale per row (Int8Method): those are one torch call a
    layer anyway, an expert loop is one per chosen expert."""

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        super().create_weights(layer, [_as_q8_0(s) for s in sources], device)


def _as_q8_0(source: WeightSource) -> GGUFBlockWeight:
    import gguf

    if isinstance(source, GGUFBlockWeight) and source.qtype == "Q8_0":
        return source
    w = (source.dequantize() if isinstance(source, GGUFBlockWeight) else source).float()
    blocks = gguf.quants.quantize(w.contiguous().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return GGUFBlockWeight("Q8_0", tuple(w.shape), blocks)


_FALLBACK_LOGGED: set[str] = set()


class GGUFMethod(_ChosenPerLayer):
    """`--quantization gguf`: each linear on the kernel of its checkpoint's type, chosen when
    its weights arrive (a K-quant mix gives different types to different layers):
    GGUFNativeMethod for the types in `KQ_KIND`; a dense F16 / BF16 / F32 matrix on the bf16
    dense path; any other GGUF type (Q2_K, Q3_K, IQ2/IQ3...) dequantized and requantized to
    int8 per row, with a log line naming the type. The method the layer took is
    `layer.gguf_method`; float32 activations come in and go to it in its own dtype."""

    input_dtype = torch.float32
    # every row count runs the kernel: `--enable-deterministic-inference` has nothing to change
    _native = GGUFNativeMethod()

    def _choose(self, sources: list[WeightSource], rows: int) -> LinearMethod:
        from sglang_like.layers.quantization.dense import DenseMethod
        from sglang_like.layers.quantization.int8 import Int8Method

        types = {s.qtype if isinstance(s, GGUFBlockWeight) else "dense" for s in sources}
        cols = sources[0].shape[1]
        if types <= set(KQ_KIND) and all(s.shape[0] % _ROWS == 0 for s in sources) \
                and cols % BLOCK == 0:
            return self._native
        if types == {"dense"}:
            return DenseMethod(torch.bfloat16)
        key = ",".join(sorted(types))
        if key not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(key)
            logger.warning("GGUF %s matrices [%d, %d] have no native kernel here: dequantized "
                           "and requantized to int8 per row", key, rows, cols)
        return Int8Method()

    def create_weights(self, layer: nn.Module, sources: list[WeightSource],
                       device: torch.device) -> None:
        method = self._choose(sources, sum(s.shape[0] for s in sources))
        layer.gguf_method = method
        method.create_weights(layer, sources, device)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        method = layer.gguf_method
        return method.apply(layer, x.to(method.input_dtype)).float()

    def decode_fn(self, layer: nn.Module):
        method = layer.gguf_method
        fn = method.decode_fn(layer)
        if method.input_dtype == torch.float32:
            return fn
        dtype = method.input_dtype
        return lambda x: fn(x.to(dtype)).float()
