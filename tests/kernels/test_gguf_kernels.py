"""kquants.c: GGUF's Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / IQ4_XS
matrices multiplied in their own codes, against gguf-py's dequantizer, on every ISA variant
this CPU runs (AVX2 forced on AVX-512 machines too).

Bounds, from the arithmetic:
- repacking: the codes are the file's; a K type's scale and min (d * sc, dmin * m) and an
  IQ4_XS block's d * (ls - 32) are rounded to fp16, so an element is off by at most 2^-11 of
  |scale * (code - offset)| + |min| (plus gguf-py's own fp32 rounding); the other types'
  scales are the file's fp16 numbers and dequantize exactly.
- the matmul: activations rounded to int8 per 32 columns (amax / 127), then integer dots
  and fp32 sums; against the rounded activations times the dequantized matrix only the
  summation order differs (relative 1e-5 of sum |x| |w|), and against the fp32 activations
  each element of x moves by at most half its block's step (amax / 254).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sglang_like.layers.quantization import GGUFBlockWeight, GGUFNativeMethod, QuantLinear
from sglang_like.layers.quantization.gguf_native import KQ_KIND, OFFSET, block_codes, pack
from sglang_like.layers.quantization.q4_native import int8_blocks_rounded
from sglang_like_kernels import cpu
from sglang_like_kernels.cpu import amx

from ..gguf_quantize import quantize

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")

ISAS = cpu.supported_isas()
QTYPES = list(KQ_KIND)
# the types whose repacked scales are the file's own fp16 numbers (no folding)
EXACT = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}
# fp16 fields of a block (byte offsets) that random bytes must not turn into inf / NaN
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "IQ4_NL": [0], "IQ4_XS": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFBlockWeight:
    """Blocks of random bytes (every code and sub-scale pattern) with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scale = (rng.uniform(0.2, 2.0, size=(rows, cols // bs)) * 1e-3).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, cols // bs, 2)
    return GGUFBlockWeight(qtype, (rows, cols), raw.reshape(rows, -1))


def quantized_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFBlockWeight:
    """A Gaussian matrix through the test-owned quantizer (IQ4_XS: random blocks)."""
    if qtype == "IQ4_XS":
        return random_blocks(qtype, rows, cols, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return GGUFBlockWeight(qtype, (rows, cols), quantize(w, qtype))


def repack_bound(w: GGUFBlockWeight) -> torch.Tensor:
    """Per element: how far the repacked matrix may be from gguf-py's (see the module doc)."""
    codes, d, m = block_codes(w)
    offset = OFFSET.get(KQ_KIND[w.qtype], 0)
    rows, cols = w.shape
    scale = np.repeat(d, cols // d.shape[1], axis=1)
    term = np.abs(scale * (codes.astype(np.float32) - offset))
    if m is not None:
        term += np.repeat(np.abs(m), 32, axis=1)
    fp16 = 0.0 if w.qtype in EXACT else 2.0 ** -11
    return torch.from_numpy(term * fp16 + 1e-6 * term + 1e-12)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("make", [random_blocks, quantized_blocks], ids=["random", "gaussian"])
def test_repack_holds_the_files_values(qtype, make) -> None:
    w = make(qtype, 48, 512)
    want = w.dequantize()
    kind, packed = pack(w)
    for isa in ISAS:
        got = cpu.kq_dequantize(packed, kind, 48, 512, variant=isa)
        err = (got - want).abs()
        assert (err <= repack_bound(w)).all(), (isa, err.max().item())
        if qtype in EXACT:
            assert torch.equal(got, want), isa


@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_matches_dequantized_matrix(qtype) -> None:
    rows, cols = 64, 768 if qtype not in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 1024
    w = quantized_blocks(qtype, rows, cols, seed=3)
    want_w = w.dequantize()
    kind, packed = pack(w)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(5))
    x[3] = 0.0  # an all-zero row: zero scales, no division by zero
    x[4, :32] = 1e-30  # a block of tiny values
    exact = x.double() @ want_w.double().T
    rounded = int8_blocks_rounded(x)
    # |x - rounded| <= amax / 254 per block of 32 columns
    step = x.reshape(11, -1, 32).abs().amax(-1) / 254.0
    act_bound = (step.repeat_interleave(32, dim=1).double() @ want_w.abs().double().T)
    for isa in ISAS:
        y = cpu.kq_matmul(x, packed, kind, rows, variant=isa)
        deq = cpu.kq_dequantize(packed, kind, rows, cols, variant=isa)
        order = (rounded.abs().double() @ deq.abs().double().T) * 1e-5 + 1e-9
        assert ((y.double() - rounded.double() @ deq.double().T).abs() <= order).all(), isa
        repack = x.abs().double() @ repack_bound(w).double().T
        assert ((y.double() - exact).abs() <= act_bound + repack + order).all(), isa
        assert torch.equal(y[3], torch.zeros(rows)), isa


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_NL"])
def test_a_rows_result_does_not_depend_on_the_batch(qtype) -> None:
    w = quantized_blocks(qtype, 32, 512, seed=7)
    kind, packed = pack(w)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(9))
    for isa in ISAS:
        batch = cpu.kq_matmul(x, packed, kind, 32, variant=isa)
        for i in (0, 5, 12):
            alone = cpu.kq_matmul(x[i:i + 1], packed, kind, 32, variant=isa)
            assert torch.equal(alone[0], batch[i]), (isa, i)


def test_isas_agree_to_float_rounding() -> None:
    """VNNI (unsigned codes, offsets subtracted) and AVX2 (signed values where maddubs would
    saturate) compute the same integer dots: results equal to float summation order."""
    if len(ISAS) < 2:
        pytest.skip("this CPU runs one variant")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    for qtype in QTYPES:
        kind, packed = pack(quantized_blocks(qtype, 32, 512, seed=4))
        a, b = (cpu.kq_matmul(x, packed, kind, 32, variant=v) for v in ISAS[:2])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_partitions_of_different_types() -> None:
    """A K-quant mix gives q/k/v different types: each runs on its own kernel, one output."""
    parts = [quantized_blocks(qt, 64, 512, seed=i)
             for i, qt in enumerate(["Q5_0", "Q5_0", "Q8_0"])]
    lin = QuantLinear(GGUFNativeMethod(), 512, [64, 64, 64], ["q", "k", "v"])
    lin.load_weights({f"x.{n}.weight": p for n, p in zip("qkv", parts, strict=True)}, "x.",
                     torch.device("cpu"))
    assert [k for k, _, _ in lin.kq_runs] == ["q5o", "q8"]  # q and k share one call
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.method.dequantize(lin), want)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), int8_blocks_rounded(x) @ want.T, rtol=1e-4, atol=1e-4)
    # a prefill-sized forward runs the same kernel: its rows are the same bits as alone
    xl = torch.randn(300, 512, generator=torch.Generator().manual_seed(2))
    yl = lin(xl)
    torch.testing.assert_close(yl, int8_blocks_rounded(xl) @ want.T, rtol=1e-4, atol=1e-4)
    assert torch.equal(yl[257], lin(xl[257:258])[0])


@pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("make", [random_blocks, quantized_blocks], ids=["random", "gaussian"])
def test_amx_tiles_give_the_vector_kernels_bits(make) -> None:
    """amx_kq.c multiplies every kind's records on AMX-INT8 tiles: the same integer dots and
    float steps as kquants.c's VNNI kernel, so every row is the same bits at row counts
    below, at and above a 16-row tile, a 128-row work item and the switch-over thresholds:
    called alone, through GGUFNativeMethod (which switches by row count) and through the
    native library's own dispatch (the fused decode step's and the MoE layers' path)."""
    for qtype in QTYPES:
        w = make(qtype, 48, 512, seed=11)
        kind, packed = pack(w)
        lin = QuantLinear(GGUFNativeMethod(), 512, [48], ["w"])
        lin.load_weights({"x.w.weight": w}, "x.", torch.device("cpu"))
        for m in (1, 5, 16, 33, 64, 150):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
            want = cpu.kq_matmul(x, packed, kind, 48, variant="avx512_vnni")
            assert torch.equal(amx.kq_matmul(x, packed, cpu.KQ_KINDS[kind], 48), want), (qtype, m)
            assert torch.equal(lin(x), want), (qtype, m)
            assert torch.equal(cpu.kq_native_step_matmul(x, packed, kind, 48), want), (qtype, m)
    # the x16 Q4_1 layout is the Q4_K kind's record: tiles = q4_rows.c's kernel
    blocks = torch.from_numpy(np.ascontiguousarray(quantized_blocks("Q4_1", 48, 512).blocks))
    x16 = cpu.q4_x16_pack(blocks, 48, 512)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(3))
    want = cpu.q4_x16_matmul(x, x16, 48)
    assert torch.equal(amx.kq_matmul(x, x16, -1, 48), want)
    assert torch.equal(cpu.kq_native_step_matmul(x, x16, None, 48), want)


def test_rows_past_a_pass_are_the_same_bits() -> None:
    """The native step's matmul takes a long prompt's rows in passes that stay in L2
    (kq_pass_rows: at most 256 rows at K = 4,096 on any machine): every row is the same bits
    as the vector kernel's single pass over all of them, tiles or not."""
    x = torch.randn(300, 4096, generator=torch.Generator().manual_seed(5))
    for qtype in ("Q4_K", "Q6_K", "Q8_0"):
        kind, packed = pack(quantized_blocks(qtype, 32, 4096, seed=6))
        assert torch.equal(cpu.kq_native_step_matmul(x, packed, kind, 32),
                           cpu.kq_matmul(x, packed, kind, 32)), qtype
    blocks = torch.from_numpy(np.ascontiguousarray(quantized_blocks("Q4_1", 32, 4096).blocks))
    x16 = cpu.q4_x16_pack(blocks, 32, 4096)
    assert torch.equal(cpu.kq_native_step_matmul(x, x16, None, 32), cpu.q4_x16_matmul(x, x16, 32))


def test_bad_shapes_and_types_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        block_codes(GGUFBlockWeight("Q4_K", (16, 288), np.zeros((16, 162), np.uint8)))
    with pytest.raises(ValueError, match="no native kernel for GGUF type Q3_K"):
        block_codes(GGUFBlockWeight("Q3_K", (16, 256), np.zeros((16, 110), np.uint8)))
    kind, packed = pack(quantized_blocks("Q5_0", 16, 64))
    with pytest.raises(RuntimeError, match="kq_matmul failed"):
        cpu.kq_matmul(torch.randn(2, 48), packed, kind, 16)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_NL"])
def test_a_matrix_repacks_the_same_in_chunks_of_rows(qtype, monkeypatch) -> None:
    """pack() repacks a tall matrix a chunk of rows at a time (the load's peak memory): the
    bytes are those of one pass over it, a short last chunk included."""
    from sglang_like.layers.quantization import gguf_native

    w = quantized_blocks(qtype, 80, 256, seed=2)
    whole = pack(w)
    monkeypatch.setattr(gguf_native, "_PACK_ROWS", 32)  # 80 rows: chunks of 32, 32, 16
    chunked = pack(w)
    assert chunked[0] == whole[0] and torch.equal(chunked[1], whole[1])


@pytest.mark.parametrize("qtype", QTYPES)
def test_head_and_embeddings_stay_in_the_files_type(qtype) -> None:
    """`gguf`'s LM head / tied embedding and its untied embedding (QuantConfig's methods): a
    type kquants.c runs, other than Q8_0, stays in its codes: logits are the kernel's, the
    rows an embedding gathers are the values the kernel multiplies (bit for bit) and the
    file's within the repack bound, in fewer bytes than the int8 head's rows. A Q8_0 matrix
    is those int8 rows already and takes the Q8_0 head."""
    from sglang_like.layers.quantization import (
        GGUFRowsMethod,
        Int8EmbeddingMethod,
        Q8HeadMethod,
        QuantConfig,
    )

    config = QuantConfig("gguf", torch.float32)
    w = quantized_blocks(qtype, 64, 256, seed=3)
    head = QuantLinear(config.head_method(256), 256, [64], ["embed_tokens"])
    head.load_weights({"m.embed_tokens.weight": w}, "m.", torch.device("cpu"))
    embed = QuantLinear(config.embedding_method(), 256, [64], ["embed_tokens"])
    embed.load_weights({"m.embed_tokens.weight": w}, "m.", torch.device("cpu"))
    if qtype == "Q8_0":
        assert isinstance(head.gguf_method, Q8HeadMethod)
        assert isinstance(embed.gguf_method, Int8EmbeddingMethod)
        return
    assert isinstance(head.gguf_method, GGUFRowsMethod)
    assert isinstance(embed.gguf_method, GGUFRowsMethod)
    ids = torch.tensor([0, 15, 16, 63, 15, 40])
    kernel_values = head.method.dequantize(head)
    for lin in (head, embed):
        rows = lin.method.embed(lin, ids)
        assert torch.equal(rows, kernel_values[ids])
        assert ((rows - w.dequantize()[ids]).abs() <= repack_bound(w)[ids]).all()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    (kind, n, packed), = head.gguf_method.packed_runs(head)
    assert torch.equal(head(x), cpu.kq_matmul(x, packed, kind, n))
    int8_rows = QuantLinear(Q8HeadMethod(), 256, [64], ["w"])
    int8_rows.load_weights({"m.w.weight": w}, "m.", torch.device("cpu"))
    assert head.method.weight_bytes(head) < 0.8 * int8_rows.method.weight_bytes(int8_rows)
    assert head.method.decode_bytes(head) == head.method.weight_bytes(head)
    assert embed.method.decode_bytes(embed) == 0  # a step gathers its tokens' rows only
    with pytest.raises(IndexError, match="outside"):
        embed.method.embed(embed, torch.tensor([64]))


def test_types_without_a_kernel_take_int8_and_say_so(caplog) -> None:
    """GGUFMethod: a type kquants.c does not run (Q3_K here) is dequantized and requantized
    to int8 per row with a log line naming it; a dense F16 matrix runs dense in bf16."""
    import logging

    from sglang_like.layers.quantization import DenseMethod, GGUFMethod, Int8Method

    q3 = random_blocks_any("Q3_K", 32, 256)
    with caplog.at_level(logging.WARNING):
        lin = QuantLinear(GGUFMethod(), 256, [32], ["w"])
        lin.load_weights({"x.w.weight": q3}, "x.", torch.device("cpu"))
    assert isinstance(lin.gguf_method, Int8Method)
    assert "Q3_K" in caplog.text and "int8" in caplog.text
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    want = x @ q3.dequantize().T
    torch.testing.assert_close(lin(x), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    dense = QuantLinear(GGUFMethod(), 256, [32], ["w"])
    dense.load_weights({"x.w.weight": torch.randn(32, 256).half().float()}, "x.",
                       torch.device("cpu"))
    assert isinstance(dense.gguf_method, DenseMethod)
    assert dense(x).dtype == torch.float32


def random_blocks_any(qtype: str, rows: int, cols: int) -> GGUFBlockWeight:
    """Random bytes as blocks of a type this module has no fp16-field table for, with every
    2-byte word a small fp16 (so no scale is inf / NaN)."""
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(rows, cols // bs * ts), dtype=np.uint8)
    if qtype == "Q3_K":  # its fp16 d is the block's last two bytes
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // bs)) * 1e-2).astype(np.float16)
        raw.reshape(rows, cols // bs, ts)[..., ts - 2:] = d.view(np.uint8).reshape(
            rows, cols // bs, 2)
    return GGUFBlockWeight(qtype, (rows, cols), raw)


def _tiny_gguf(path, name: str = "blk.0.ffn_down.weight") -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, np.ones((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_truncated_or_unknown_file_names_the_tensor(tmp_path) -> None:
    from sglang_like.model_loader.gguf_file import read_gguf

    good = tmp_path / "good.gguf"
    _tiny_gguf(good)
    assert read_gguf(str(good)).tensors[0].shape == (32, 64)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"truncated or corrupt: tensor 'blk.0.ffn_down.weight'"):
        read_gguf(str(cut))
    # the tensor info: name, n_dims (u32), dims (u64 each), type (u32)
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2
    patched = bytearray(data)
    patched[at:at + 4] = (999).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(patched))
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' has an unknown GGML type 999"):
        read_gguf(str(odd))


def test_a_biased_linear_adds_its_bias_once_on_every_path() -> None:
    """Qwen2-style qkv biases: the module's forward (prefill) and the decode closure agree."""
    w = quantized_blocks("Q5_0", 32, 256, seed=2)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(3))
    lin = QuantLinear(GGUFNativeMethod(), 256, [32], ["w"], bias=True)
    lin.load_weights({"x.w.weight": w, "x.w.bias": bias}, "x.", torch.device("cpu"))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    want = int8_blocks_rounded(x) @ w.dequantize().T + bias
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(lin.method.decode_fn(lin)(x), lin(x))
