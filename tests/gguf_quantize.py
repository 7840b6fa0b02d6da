"""Test-owned GGUF quantizer and writer: K-quants and IQ4_NL in numpy, and GGUF requantization.

gguf-py quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but only dequantizes Q4_K/Q5_K/Q6_K/IQ4_NL; this
module writes those four itself (vectorized numpy, byte layouts as ggml's `block_*` structs) so
tests can build GGUF files of every block type the CPU kernels read, without llama.cpp.

Rounding (one pass, no search), per sub-block of the super-block (256) or block (IQ4_NL, 32):

| type   | sub-blocks | decoded value            | stored scales                                  |
|--------|------------|--------------------------|------------------------------------------------|
| Q4_K   | 8 x 32     | d*sc*q - dmin*m, q 0..15 | sc, m: 6 bits; d, dmin: fp16                   |
| Q5_K   | 8 x 32     | d*sc*q - dmin*m, q 0..31 | as Q4_K                                        |
| Q6_K   | 16 x 16    | d*sc*q, q -32..31        | sc: int8, its sign puts -32 on the longer side |
| IQ4_NL | 1 x 32     | d*kvalues[q]             | d: fp16, its sign puts -127 on the longer side |

Each sub-block's step (and, for Q4_K/Q5_K, offset dmin*m >= -min(x, 0)) is the smallest whose grid
covers the sub-block's values; the fp16 super-scales (max over sub-blocks / 63 or / 127) and the
sub-block codes sc, m (step / d, offset / dmin) are rounded up (ceil), never down, so no element is
clipped; element codes are round-to-nearest (np.rint, ties to even) on the grid as stored. Hence
for Q4_K/Q5_K/Q6_K every element has |x - dequant(x)| <= d*|sc|/2, and for IQ4_NL q is the nearest
table entry for the stored d and |x - dequant(x)| <= 12*|d| (half the table's widest gap).

RMS(x - dequant(x)) / RMS(x) on N(0, 1) weights [256, 4096]: Q4_K 0.080, Q5_K 0.039, Q6_K 0.019,
IQ4_NL 0.081 (llama.cpp's quantizer, which searches for the scales, on the same data: 0.071, 0.036,
0.018, 0.076). Throughput about 50 M weights/s on one core.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

_QK_K = 256
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)
"""ggml's kvalues_iq4nl: the 16 levels an IQ4_NL code indexes, in units of the block's d."""

# the nearest IQ4_NL code for x/d, looked up by floor(2*x/d) + 256: every midpoint between two
# levels is a multiple of 1/2, so each half-unit cell [k/2, k/2 + 1/2) has one nearest level
_IQ4_NL_NEAREST = np.searchsorted(
    (IQ4_NL_VALUES[1:] + IQ4_NL_VALUES[:-1]) / 2, (np.arange(512) - 256) / 2 + 0.25
).astype(np.uint8)
_CHUNK_ELEMENTS = 1 << 20  # rows are quantized in slabs of about this many weights (cache-sized)


# ---------------------------------------------------------------------------------------------
# block quantizers: float32 [num_blocks, block_size] -> uint8 [num_blocks, type_size]
# ---------------------------------------------------------------------------------------------


def _fp16_up(value: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= value (value >= 0, float32); a scale rounded so it still covers."""
    if (value > np.finfo(np.float16).max).any():
        raise ValueError("weights too large for fp16 block scales")
    half = value.astype(np.float16)
    low = half.astype(np.float32) < value
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half


def _safe_inverse(step: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(step == 0, np.float32(0), np.float32(1) / step).astype(np.float32)


def _ceil_ratio(need: np.ndarray, unit: np.ndarray, max_code: int) -> np.ndarray:
    """ceil(need / unit) in 0..max_code (0 where unit is 0): the code whose step covers `need`."""
    codes = np.ceil(need * _safe_inverse(unit))
    return np.clip(codes, 0, max_code).astype(np.uint8)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """get_scale_k4's inverse: 8 six-bit scales and mins -> 12 bytes (ggml's K_SCALE_SIZE).

    bytes 0-3: sc[0:4] | top 2 bits of sc[4:8] << 6;  bytes 4-7: the same for the mins;
    bytes 8-11: low 4 bits of sc[4:8] | low 4 bits of m[4:8] << 4.
    """
    packed = np.empty((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return packed


def _affine_k_codes(blocks: np.ndarray, max_q: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's shared part: codes [n, 8, 32] in 0..max_q, fp16 d and dmin, 6-bit sc and m."""
    sub = blocks.reshape(-1, 8, 32)
    need_offset = np.maximum(-sub.min(axis=-1), 0)  # ggml keeps each sub-block's min <= 0
    dmin = _fp16_up(need_offset.max(axis=-1) / 63)
    mins = _ceil_ratio(need_offset, dmin.astype(np.float32)[:, None], 63)
    offset = dmin.astype(np.float32)[:, None] * mins  # >= need_offset: the lowest value fits
    need_step = (sub.max(axis=-1) + offset) / max_q
    d = _fp16_up(need_step.max(axis=-1) / 63)
    scales = _ceil_ratio(need_step, d.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * scales
    codes = np.rint((sub + offset[..., None]) * _safe_inverse(step)[..., None])
    return np.clip(codes, 0, max_q).astype(np.uint8), d, dmin, scales, mins


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K (144 B): fp16 d, fp16 dmin, scales[12], qs[128]; x = d*sc*q - dmin*m."""
    codes, d, dmin, scales, mins = _affine_k_codes(blocks, 15)
    # qs[32*j + l]: low nibble sub-block 2j, high nibble sub-block 2j+1, element l of each
    qs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_k_scales(scales, mins), qs.reshape(-1, 128)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K (176 B): d, dmin, scales[12], qh[32], qs[128]; x = d*sc*q - dmin*m."""
    codes, d, dmin, scales, mins = _affine_k_codes(blocks, 31)
    low = codes & 0x0F
    qs = low[:, 0::2] | (low[:, 1::2] << 4)
    # qh[l] bit i: the fifth bit of sub-block i's element l
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce((codes >> 4) << shifts, axis=1)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_k_scales(scales, mins), qh, qs.reshape(-1, 128)], axis=1)


def _signed_step(pos: np.ndarray, neg: np.ndarray, low: float, high: float) -> np.ndarray:
    """The smallest signed step s whose grid [low*s, high*s] (low < 0 < high) holds [-neg, pos].

    With s > 0 the negative side gets the longer reach |low|; with s < 0 the positive side does.
    """
    up = np.maximum(neg / -low, pos / high)
    down = np.maximum(pos / -low, neg / high)
    return np.where(down < up, -down, up)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K (210 B): ql[128], qh[64], int8 scales[16], fp16 d; x = d*sc*(q - 32)."""
    sub = blocks.reshape(-1, 16, 16)
    need = _signed_step(np.maximum(sub.max(axis=-1), 0), np.maximum(-sub.min(axis=-1), 0), -32, 31)
    d = _fp16_up(np.abs(need).max(axis=-1) / 127)
    magnitude = _ceil_ratio(np.abs(need), d.astype(np.float32)[:, None], 127)
    scales = np.where(need < 0, -magnitude.astype(np.int8), magnitude.astype(np.int8))
    step = d.astype(np.float32)[:, None] * scales
    codes = np.clip(np.rint(sub * _safe_inverse(step)[..., None]), -32, 31)
    codes = (codes + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, quarter, l]
    low = (codes & 0x0F).reshape(-1, 2, 2, 64)
    ql = low[:, :, 0] | (low[:, :, 1] << 4)  # ql[64h + l]: elements 128h + l and 128h + 64 + l
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce((codes >> 4) << shifts, axis=2)  # qh[32h + l] bits 2k: 128h + 32k + l
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8),
         d.view(np.uint8).reshape(-1, 2)], axis=1)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """block_iq4_nl (18 B): fp16 d, qs[16]; x = d*kvalues[q], q nearest for the stored d."""
    pos, neg = np.maximum(blocks.max(axis=-1), 0), np.maximum(-blocks.min(axis=-1), 0)
    need = _signed_step(pos, neg, float(IQ4_NL_VALUES[0]), float(IQ4_NL_VALUES[-1]))
    d = _fp16_up(np.abs(need)) * np.sign(need).astype(np.float16)
    cells = np.floor(blocks * (2 * _safe_inverse(d.astype(np.float32)))[:, None])
    codes = _IQ4_NL_NEAREST[np.clip(cells, -256, 255).astype(np.int16) + 256]
    qs = codes[:, :16] | (codes[:, 16:] << 4)  # qs[l]: elements l (low) and 16 + l (high)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)


_BLOCK_QUANTIZERS: dict[str, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    "Q4_K": (_QK_K, _q4_k),
    "Q5_K": (_QK_K, _q5_k),
    "Q6_K": (_QK_K, _q6_k),
    "IQ4_NL": (32, _iq4_nl),
}
_GGUF_PY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32")
QTYPES = tuple(_BLOCK_QUANTIZERS) + _GGUF_PY_TYPES
"""The qtype names `quantize` accepts (GGMLQuantizationType names)."""


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float rows [rows, cols] to GGUF blocks: uint8 [rows, bytes_per_row].

    Q4_K/Q5_K/Q6_K/IQ4_NL are quantized here (see the module docstring for the rounding); the
    other types in QTYPES go through gguf-py. cols must be a multiple of the type's block size.
    """
    if qtype not in QTYPES:
        raise ValueError(f"unsupported qtype {qtype!r}; expected one of {QTYPES}")
    if array.ndim != 2:
        raise ValueError(f"expected a 2-D array [rows, cols], got shape {array.shape}")
    rows = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise ValueError("cannot quantize NaN or infinite weights")
    block_size, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    num_rows, num_cols = rows.shape
    if num_cols % block_size:
        raise ValueError(f"{qtype} needs a row length divisible by {block_size}, got {num_cols}")
    if qtype in _GGUF_PY_TYPES:
        return gguf.quants.quantize(rows, T[qtype]).view(np.uint8).reshape(num_rows, -1)
    _, quantize_blocks = _BLOCK_QUANTIZERS[qtype]
    out = np.empty((num_rows, num_cols // block_size * type_size), dtype=np.uint8)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(num_cols, 1))
    for start in range(0, num_rows, rows_per_chunk):
        chunk = rows[start:start + rows_per_chunk]
        out[start:start + rows_per_chunk] = quantize_blocks(chunk.reshape(-1, block_size)).reshape(
            len(chunk), -1)
    return out


# ---------------------------------------------------------------------------------------------
# llama-quantize's recipes (llama.cpp src/llama-quant.cpp, as vendored by llama-cpp-python 0.3.36)
# ---------------------------------------------------------------------------------------------

_FileType = gguf.LlamaFileType
RECIPES: dict[str, tuple[str, _FileType]] = {
    "Q4_0": ("Q4_0", _FileType.MOSTLY_Q4_0),
    "Q4_1": ("Q4_1", _FileType.MOSTLY_Q4_1),
    "Q5_0": ("Q5_0", _FileType.MOSTLY_Q5_0),
    "Q5_1": ("Q5_1", _FileType.MOSTLY_Q5_1),
    "Q8_0": ("Q8_0", _FileType.MOSTLY_Q8_0),
    "Q4_K_S": ("Q4_K", _FileType.MOSTLY_Q4_K_S),
    "Q4_K_M": ("Q4_K", _FileType.MOSTLY_Q4_K_M),
    "Q5_K_S": ("Q5_K", _FileType.MOSTLY_Q5_K_S),
    "Q5_K_M": ("Q5_K", _FileType.MOSTLY_Q5_K_M),
    "Q6_K": ("Q6_K", _FileType.MOSTLY_Q6_K),
    "IQ4_NL": ("IQ4_NL", _FileType.MOSTLY_IQ4_NL),
    "F16": ("F16", _FileType.MOSTLY_F16),
    "BF16": ("BF16", _FileType.MOSTLY_BF16),
    "F32": ("F32", _FileType.ALL_F32),
}
"""Recipe (llama-quantize's ftype name) -> (the type most 2-D weights get, general.file_type)."""

# tensor_type_fallback: a 256-block type whose row length is not a multiple of 256 falls back to
# a 32-block type; a 32-block type that still does not divide the row becomes F16
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# tensor_allows_quantization: names (besides 1-D tensors, norms and non-"weight" tensors) that
# llama-quantize copies unchanged
_NEVER_QUANTIZED = ("ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "position_embd.weight", "token_types.weight",
                    "ssm_conv1d", "shortconv.conv.weight", "time_mix_", "attn_rel_b.weight",
                    ".rel_pos", ".patch_embd", ".patch_merger")
_LAYER = re.compile(r"blk\.(\d+)\.")


def _block_size(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[T[qtype]][0]


def _is_quantized(qtype: str) -> bool:
    return qtype not in ("F32", "F16", "BF16")


def _allows_quantization(tensor: gguf.ReaderTensor) -> bool:
    name = tensor.name
    return (len(tensor.shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and not any(part in name for part in _NEVER_QUANTIZED))


def _category(name: str) -> str:
    """tensor_get_category, with attn_qkv / attn_kv_b folded into attn_v (category_is_attn_v)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"):
        if part in name:
            return "attn_v"
    for part in ("ffn_down", "ffn_up", "ffn_gate"):  # the ones a recipe reads: ffn_down only
        if part in name:
            return part
    return "other"


def _use_more_bits(i_layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, every third between."""
    return (i_layer < num_layers // 8 or i_layer >= 7 * num_layers // 8
            or (i_layer - num_layers // 8) % 3 == 2)


def _mixture_type(recipe: str, base: str, category: str, ne0: int, index: int, count: int,
                  is_tied: bool) -> str:
    """llama_tensor_get_type_impl's rules for the recipes in RECIPES (dense, non-Falcon models).

    index / count: the tensor's rank among its category's tensors (the layer, for attn_v and
    ffn_down), as llama.cpp's i_attention_wv / n_attention_wv and i_ffn_down / n_layer.
    """
    if category == "output" or (category == "token_embd" and is_tied):
        if ne0 % _block_size(base):
            return "Q8_0"
        return base if base == "Q8_0" else "Q6_K"
    more_bits = _use_more_bits(index, count)
    if category == "attn_v":
        if recipe in ("Q4_K_M", "Q5_K_M") and more_bits:
            return "Q6_K"
        if recipe == "Q4_K_S" and index < 4:
            return "Q5_K"
    if category == "ffn_down":
        if recipe in ("Q4_K_M", "Q5_K_M") and more_bits:
            return "Q6_K"
        if recipe == "Q4_K_S" and index < count // 8:
            return "Q5_K"
    return base


def _fallback(qtype: str, ne0: int) -> str:
    if ne0 % _block_size(qtype) == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ne0 % _block_size(qtype) == 0 else "F16"


def plan_tensor_types(
    reader: gguf.GGUFReader, recipe: str, *, pure: bool = False
) -> dict[str, str]:
    """Tensor name -> the GGML type name `recipe` gives it, as llama-quantize would choose.

    Tensors llama-quantize never quantizes (1-D, norms, ...) keep their type. "IQ4_NL" is pure
    (every 2-D weight IQ4_NL, F16 where a row is not a multiple of 32), as `llama-quantize
    --pure`; pure=True does the same for any recipe (llama.cpp's IQ4_NL ftype instead mixes in
    Q5_K/Q6_K/Q8_0, as the other recipes' mixtures do).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {tuple(RECIPES)}")
    base, _ = RECIPES[recipe]
    pure = pure or recipe == "IQ4_NL"
    arch = reader.fields["general.architecture"].contents()
    num_layers = int(reader.fields[f"{arch}.block_count"].contents())
    is_tied = all(t.name != "output.weight" for t in reader.tensors)
    # llama.cpp walks tensors sorted by (layer, name), counting attn_v and ffn_down as it goes
    ordered = sorted(reader.tensors, key=lambda t: (_layer_of(t.name), t.name))
    counts = {"attn_v": sum(_category(t.name) == "attn_v" for t in ordered), "ffn_down": num_layers}
    seen = {"attn_v": 0, "ffn_down": 0}
    plan = {}
    for tensor in ordered:
        ne0 = int(tensor.shape[0])
        if not _allows_quantization(tensor):
            plan[tensor.name] = tensor.tensor_type.name
        elif not _is_quantized(base):
            plan[tensor.name] = base
        else:
            qtype = base
            if not pure:
                category = _category(tensor.name)
                index, count = seen.get(category, 0), counts.get(category, 0)
                qtype = _mixture_type(recipe, base, category, ne0, index, count, is_tied)
                if category in seen:
                    seen[category] += 1
            plan[tensor.name] = _fallback(qtype, ne0)
    return {t.name: plan[t.name] for t in reader.tensors}


def _layer_of(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    """Every key/value but the reader's GGUF.* and the writer's own general.architecture, with
    general.file_type and general.quantization_version set as llama-quantize sets them."""
    overrides = {"general.file_type": file_type,
                 "general.quantization_version": gguf.GGML_QUANT_VERSION}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        if field.name in overrides:
            writer.add_uint32(field.name, overrides.pop(field.name))
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ValueError(f"{field.name}: nested arrays are not supported")
            sub_type = field.types[1]
            if sub_type == gguf.GGUFValueType.STRING:  # raw bytes: no UTF-8 round trip
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(field.name, bytes(field.parts[-1]), value_type)
        else:
            writer.add_key_value(field.name, field.contents(), value_type)
    for key, value in overrides.items():
        writer.add_uint32(key, value)


def requantize_gguf(src: str | Path | gguf.GGUFReader, dst_path: str | Path, recipe: str, *,
                    pure: bool = False) -> dict[str, str]:
    """Write the model in `src` (a path, or a GGUFReader already open on it: reading the
    tokenizer's strings takes seconds) to `dst_path` with its tensors in `recipe`'s types.

    Metadata (tokenizer arrays included) is copied; each tensor whose planned type
    (plan_tensor_types) differs from its own is dequantized to float32 (gguf-py) and quantized
    here; the others are copied byte for byte, as llama-quantize does. Returns name -> type name.
    """
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    plan = plan_tensor_types(reader, recipe, pure=pure)
    writer = gguf.GGUFWriter(dst_path, reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer, int(RECIPES[recipe][1]))
    for tensor in reader.tensors:
        qtype = plan[tensor.name]
        data = tensor.data
        if qtype != tensor.tensor_type.name:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            rows = quantize(weights.reshape(-1, weights.shape[-1]), qtype)
            data = rows.reshape(*weights.shape[:-1], rows.shape[-1])
        # data is uint8 [..., bytes per row] (the writer derives ne0 from raw_dtype's block size)
        # or a float array [..., ne0]; the writer reverses numpy's order into GGUF's ne order
        writer.add_tensor(tensor.name, data, raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return plan
