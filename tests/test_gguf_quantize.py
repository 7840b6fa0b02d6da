"""gguf_quantize: its blocks decode (gguf-py, the oracle) within the bound its rounding promises,
and requantize_gguf writes llama-quantize's type mixtures with the metadata intact."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from sglang_like.model_loader import default_model_path

from .gguf_quantize import IQ4_NL_VALUES, QTYPES, plan_tensor_types, quantize, requantize_gguf

OWN_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
GGUF_PY_TYPES = tuple(t for t in QTYPES if t not in OWN_TYPES)
# RMS(x - deq) / RMS(x) on N(0, 1) weights: the docstring's measurements plus a small margin
# (llama.cpp's quantizer: Q4_K 0.071, Q5_K 0.036, Q6_K 0.018, IQ4_NL 0.076)
MAX_REL_RMS = {"Q4_K": 0.085, "Q5_K": 0.042, "Q6_K": 0.021, "IQ4_NL": 0.085,
               "Q4_0": 0.09, "Q4_1": 0.09, "Q5_0": 0.045, "Q5_1": 0.04, "Q8_0": 0.006,
               "F16": 1e-3, "BF16": 5e-3, "F32": 0.0}


def _weights(case: str) -> np.ndarray:
    """[64, 512] float32: N(0, 1) with a zero row, shifted to one sign, or scaled far from 1."""
    x = np.random.default_rng(7).standard_normal((64, 512)).astype(np.float32)
    if case == "positive":  # every sub-block's min > 0: the K-quants' min offset is 0
        x = np.abs(x) + 1
    elif case == "negative":
        x = -np.abs(x) - 1
    else:
        x *= {"gaussian": 1.0, "large": 1e3, "small": 1e-4}[case]
    x[0] = 0
    return x


def _rel_rms(deq: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((deq - x) ** 2) / np.mean(x ** 2)))


def _half_steps(packed: np.ndarray, qtype: str) -> np.ndarray:
    """Per element, the largest |x - deq| nearest rounding allows on the block's stored grid:
    half the sub-block's step d*sc (K-quants) or half IQ4_NL's widest gap (24) times |d|."""
    _, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    blocks = packed.reshape(-1, type_size)
    if qtype == "IQ4_NL":
        half = 12 * np.abs(blocks[:, 0:2].view(np.float16).astype(np.float32))
        return np.repeat(half, 32, axis=1)
    if qtype == "Q6_K":
        d = blocks[:, 208:210].view(np.float16).astype(np.float32)
        step = np.abs(d * blocks[:, 192:208].view(np.int8).astype(np.float32))
        return np.repeat(step / 2, 16, axis=1)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    scales, _ = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return np.repeat(d * scales.astype(np.float32) / 2, 32, axis=1)


@pytest.mark.parametrize("case", ["gaussian", "positive", "negative", "large", "small"])
@pytest.mark.parametrize("qtype", OWN_TYPES)
def test_own_types_decode_within_half_a_step(qtype: str, case: str) -> None:
    x = _weights(case)
    block_size, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
    packed = quantize(x, qtype)
    assert packed.dtype == np.uint8 and packed.shape == (64, 512 // block_size * type_size)
    deq = gguf.quants.dequantize(packed, T[qtype])
    assert deq.shape == x.shape
    assert not deq[0].any()  # a zero row decodes to zeros
    error = np.abs(deq - x).reshape(-1, block_size)
    bound = _half_steps(packed, qtype) * (1 + 1e-5) + 1e-6 * np.abs(x).max()
    assert (error <= bound).all(), float((error - bound).max())
    if case in ("gaussian", "large", "small"):
        assert _rel_rms(deq, x) < MAX_REL_RMS[qtype]


def test_iq4_nl_codes_are_the_nearest_table_entries() -> None:
    x = _weights("gaussian")
    packed = quantize(x, "IQ4_NL")
    d = packed.reshape(-1, 18)[:, 0:2].view(np.float16).astype(np.float32)
    levels = d[:, :, None] * IQ4_NL_VALUES  # [blocks, 1, 16]
    best = np.abs(x.reshape(-1, 32)[:, :, None] - levels).min(axis=-1)
    error = np.abs(gguf.quants.dequantize(packed, T.IQ4_NL) - x).reshape(-1, 32)
    assert (error <= best + 1e-6).all()


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES)
def test_other_types_are_gguf_py_s(qtype: str) -> None:
    x = _weights("gaussian")
    packed = quantize(x, qtype)
    expected = gguf.quants.quantize(x, T[qtype]).view(np.uint8).reshape(64, -1)
    np.testing.assert_array_equal(packed, expected)
    assert _rel_rms(gguf.quants.dequantize(packed, T[qtype]), x) <= MAX_REL_RMS[qtype]


@pytest.mark.parametrize("array, qtype, message", [
    (np.zeros((2, 200), np.float32), "Q4_K", "divisible by 256"),
    (np.zeros((2, 48), np.float32), "IQ4_NL", "divisible by 32"),
    (np.zeros(256, np.float32), "Q6_K", "2-D"),
    (np.full((1, 256), np.nan, np.float32), "Q5_K", "NaN"),
    (np.full((1, 256), 1e9, np.float32), "Q4_K", "too large"),
    (np.zeros((1, 256), np.float32), "Q3_K", "unsupported"),
])
def test_bad_input_is_a_value_error(array: np.ndarray, qtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(array, qtype)


# --- requantize_gguf on a tiny random llama: every rule of the mixtures, tens of ms a case -----

NUM_LAYERS = 8
FFN_LEN = 256  # ffn_down's row length: K-quants stay K-quants there whatever the hidden size
MORE_BITS = {0, 3, 6, 7}  # llama.cpp's use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2
TOKENS = ["<unk>", "a", "é", "日本", "\u0120the"] + [f"t{i}" for i in range(59)]


def _write_tiny_llama(path: Path, hidden: int, is_tied: bool) -> None:
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(NUM_LAYERS)
    writer.add_embedding_length(hidden)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_add_bos_token(False)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_scores([-float(i) for i in range(len(TOKENS))])
    shapes = {"token_embd.weight": (len(TOKENS), hidden), "output_norm.weight": (hidden,)}
    if not is_tied:
        shapes["output.weight"] = (len(TOKENS), hidden)
    for i in range(NUM_LAYERS):
        # 16 rows each (the rules read a row's length, ne0, only); ffn_down's rows are FFN_LEN
        layer = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (16, hidden),
                 "attn_k": (16, hidden), "attn_v": (16, hidden), "attn_output": (16, hidden),
                 "ffn_gate": (16, hidden), "ffn_up": (16, hidden), "ffn_down": (16, FFN_LEN)}
        shapes |= {f"blk.{i}.{part}.weight": shape for part, shape in layer.items()}
    for name, shape in shapes.items():
        weights = rng.standard_normal(shape).astype(np.float32)
        # attn_q in F16: requantizing dequantizes whatever the source holds
        writer.add_tensor(name, weights.astype(np.float16) if "attn_q" in name else weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _expected_type(recipe: str, name: str, hidden: int, is_tied: bool) -> str:
    """The type llama-quantize gives `name`, written out by hand from llama-quant.cpp's rules."""
    if "norm" in name:
        return "F32"
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q4_K_S": "Q4_K"}.get(recipe, recipe)
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    qtype = base
    is_output = name == "output.weight" or (name == "token_embd.weight" and is_tied)
    if recipe != "IQ4_NL" and is_output:
        qtype = "Q8_0" if hidden % 256 else ("Q8_0" if base == "Q8_0" else "Q6_K")
    elif recipe in ("Q4_K_M", "Q5_K_M") and ("attn_v" in name or "ffn_down" in name):
        qtype = "Q6_K" if layer in MORE_BITS else base
    elif recipe == "Q4_K_S" and "attn_v" in name and layer < 4:
        qtype = "Q5_K"
    elif recipe == "Q4_K_S" and "ffn_down" in name and layer < 1:
        qtype = "Q5_K"
    row_len = FFN_LEN if "ffn_down" in name else hidden
    if row_len % 256 and qtype in ("Q4_K", "Q5_K", "Q6_K"):
        qtype = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}[qtype]
    return "F16" if row_len % 32 else qtype


def _check_requantized(src: gguf.GGUFReader, dst: gguf.GGUFReader, recipe: str,
                       written: dict[str, str], layers: set[int] | None = None) -> None:
    """Types as `written`; shapes, metadata, weights (within the type's error) as the source's.

    layers: the blocks whose weights are compared (None: all); tensors outside blocks always are.
    """
    file_type = gguf.LlamaFileType[f"MOSTLY_{recipe}"]
    assert {t.name: t.tensor_type.name for t in dst.tensors} == written
    assert dst.fields["general.file_type"].contents() == file_type
    assert dst.fields["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.file_type", "general.quantization_version"):
            continue
        assert [t.name for t in dst.fields[key].types] == [t.name for t in field.types], key
        assert dst.fields[key].contents() == field.contents(), key
    sources = {t.name: t for t in src.tensors}
    for tensor in dst.tensors:
        source = sources[tensor.name]
        assert list(tensor.shape) == list(source.shape), tensor.name
        if layers is not None and tensor.name.startswith("blk.") and (
                int(tensor.name.split(".")[1]) not in layers):
            continue
        weights = gguf.quants.dequantize(source.data, source.tensor_type)
        deq = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert deq.shape == weights.shape
        # a tensor is a smaller sample than the Gaussian test's, and not always Gaussian
        bound = 1.25 * MAX_REL_RMS[tensor.tensor_type.name] + 1e-3
        assert _rel_rms(deq, weights) <= bound, tensor.name


@pytest.mark.parametrize("hidden", [256, 96, 48])  # 256: no fallback; 96: 32-block; 48: F16
@pytest.mark.parametrize("is_tied", [True, False])
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q5_K_M", "Q4_K_S", "Q6_K", "Q8_0", "IQ4_NL"])
def test_requantize_tiny_llama(tmp_path: Path, recipe: str, is_tied: bool, hidden: int) -> None:
    _write_tiny_llama(tmp_path / "src.gguf", hidden, is_tied)
    src = gguf.GGUFReader(tmp_path / "src.gguf")
    written = requantize_gguf(src, tmp_path / "dst.gguf", recipe)
    expected = {t.name: _expected_type(recipe, t.name, hidden, is_tied) for t in src.tensors}
    assert written == expected
    _check_requantized(src, gguf.GGUFReader(tmp_path / "dst.gguf"), recipe, written)


def test_pure_keeps_every_weight_in_the_base_type(tmp_path: Path) -> None:
    _write_tiny_llama(tmp_path / "src.gguf", 256, is_tied=True)
    plan = plan_tensor_types(gguf.GGUFReader(tmp_path / "src.gguf"), "Q4_K_M", pure=True)
    assert {t for name, t in plan.items() if "norm" not in name} == {"Q4_K"}


def test_unknown_recipe_is_a_value_error(tmp_path: Path) -> None:
    _write_tiny_llama(tmp_path / "src.gguf", 256, is_tied=True)
    with pytest.raises(ValueError, match="unknown recipe"):
        requantize_gguf(tmp_path / "src.gguf", tmp_path / "dst.gguf", "Q4_K_X")


# --- the default model (SmolLM2-135M, Q4_1): rows of 576 send most of Q4_K_M to Q5_0 ----------

SMOLLM2_MORE_BITS = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}  # use_more_bits(i, 30)


def _smollm2_q4_k_m_type(name: str) -> str:
    """llama-quantize's Q4_K_M for SmolLM2-135M (checked against its llama-quantize once)."""
    if "norm" in name:
        return "F32"
    if name == "token_embd.weight":  # tied: the output's rule, and 576 % 256 != 0
        return "Q8_0"
    layer = int(name.split(".")[1])
    if "attn_v" in name:
        return "Q8_0" if layer in SMOLLM2_MORE_BITS else "Q5_0"  # Q6_K / Q4_K, fallen back
    if "ffn_down" in name:  # rows of 1536: the only K-quant tensors
        return "Q6_K" if layer in SMOLLM2_MORE_BITS else "Q4_K"
    return "Q5_0"


@pytest.mark.slow
def test_requantize_default_model_q4_k_m(tmp_path: Path) -> None:
    src = gguf.GGUFReader(default_model_path())
    written = requantize_gguf(src, tmp_path / "smollm2-q4_k_m.gguf", "Q4_K_M")
    assert written == {t.name: _smollm2_q4_k_m_type(t.name) for t in src.tensors}
    dst = gguf.GGUFReader(tmp_path / "smollm2-q4_k_m.gguf")
    # the weights of three blocks (every type the recipe writes) keep the test under 10 s
    _check_requantized(src, dst, "Q4_K_M", written, layers={0, 3, 29})
