"""Quantized KV pools (int8, fp8 e4m3 / e5m2: codes and a float32 scale per slot and kv head):
the quantizer, the torch references over a quantized pool, the native CPU kernels against
them, the pool's size and the --kv-cache-dtype names. Triton's kernels over the same pools
are checked under the interpreter in cases_interpret.py."""

from __future__ import annotations

import math

import pytest
import torch

import sglang_like_kernels.cpu as kc
from sglang_like.layers.quantization import q4_1_blocks
from sglang_like.layers.rotary import RotaryEmbedding
from sglang_like.mem_pool import KV_CACHE_DTYPES, KVPool, resolve_kv_cache_dtype
from sglang_like_kernels import kv_quant, reference
from sglang_like_kernels.cpu import ops

QDTYPES = list(kv_quant.QUANTIZED_DTYPES)
needs_native = pytest.mark.skipif(not kc.available(), reason="needs a C compiler and AVX2")


def _quantized(shape, dtype, gen, scale=1.0):
    """(codes, scales, the float32 values they hold) of random rows of varied magnitude."""
    x = torch.randn(shape, generator=gen) * scale
    x = x * torch.logspace(-2, 1, shape[0])[:, None, None]  # rows from 0.01 to 10
    codes, scales = kv_quant.quantize(x, dtype)
    return codes, scales, kv_quant.dequantize(codes, scales)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantize_rounds_each_row_to_its_own_scale(dtype):
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 3, 50)[:, None, None]
    r[7, 1] = 0.0  # a row of zeros: scale 0, codes 0, read back as zeros
    codes, scale = kv_quant.quantize_rotated(r, dtype)
    assert codes.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (50, 3)
    assert scale[7, 1] == 0 and not codes[7, 1].float().any()
    qmax = kv_quant.QMAX[dtype]
    assert torch.equal(scale, r.abs().amax(-1) / qmax)
    back = codes.float() * scale[..., None]
    assert back[7, 1].abs().max() == 0
    err = (back - r).abs() / scale.clamp_min(1e-30)[..., None]  # in units of the scale
    # int8: half a code step; fp8: half a step of its mantissa at the value's exponent
    mantissa = {torch.int8: None, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    if mantissa is None:
        assert err.max() <= 0.5 + 1e-4
        assert codes.abs().max() == 127
    else:
        rel = ((back - r).abs() / r.abs().clamp_min(1e-30))[r.abs() > scale[..., None] * 2]
        assert rel.max() <= 2.0 ** -(mantissa + 1) + 1e-6
        assert codes.float().abs().max() == qmax


def _sylvester(n):
    w = torch.ones(1, 1)
    while w.shape[0] < n:
        w = torch.cat([torch.cat([w, w], 1), torch.cat([w, -w], 1)], 0)
    return w


@pytest.mark.parametrize("dim", [64, 40, 96, 128])
def test_rows_are_stored_rotated_and_read_back(dim):
    """quantize = quantize_rotated of W S x, S a fixed diagonal of signs (about half
    flipped) and W the Walsh-Hadamard matrix of each block of the largest power of two
    dividing D (64 -> 64, 40 -> 8, 96 -> 32); dequantize reads x back within the codes'
    rounding (the rotation is orthogonal up to its factor sqrt(B)); query_for and
    output_for frame an attention so that it reads q . k and returns sum p v."""
    b = kv_quant.block(dim)
    assert b == {64: 64, 40: 8, 96: 32, 128: 128}[dim]
    s = kv_quant.signs(dim)
    assert set(s.tolist()) == {1.0, -1.0} and abs((s < 0).sum().item() - dim / 2) < dim / 4
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(20, 2, dim, generator=gen)
    w = torch.block_diag(*[_sylvester(b)] * (dim // b))
    torch.testing.assert_close(kv_quant.rotate(x), (x * s) @ w, rtol=1e-5, atol=1e-5)
    ints = torch.randint(-100, 100, (20, dim), generator=gen).float()
    assert torch.equal(kv_quant.rotate(ints), (ints * s) @ w)  # exact sums
    assert torch.allclose(kv_quant.rotate_back(kv_quant.rotate(x)), x, atol=1e-5)
    q, k = torch.randn(5, dim, generator=gen), torch.randn(7, dim, generator=gen)
    rk = kv_quant.rotate(k)
    scores = kv_quant.query_for(q, torch.int8) @ rk.T
    torch.testing.assert_close(scores, q @ k.T, rtol=1e-4, atol=1e-4)
    p = torch.softmax(scores, -1)
    torch.testing.assert_close(kv_quant.output_for(p @ rk, torch.int8), p @ k,
                               rtol=1e-4, atol=1e-4)
    for dtype in QDTYPES:
        codes, scale = kv_quant.quantize(x, dtype)
        want = kv_quant.quantize_rotated(kv_quant.rotate(x), dtype)
        assert torch.equal(kv_quant.as_bytes(codes), kv_quant.as_bytes(want[0]))
        assert torch.equal(scale, want[1])
        back = kv_quant.dequantize(codes, scale)
        if dtype == torch.int8:  # |r - r_hat| <= scale / 2 each, and |W e| = sqrt(B) |e|
            bound = 0.5 * scale * (dim / b) ** 0.5 + 1e-5
            assert ((back - x).norm(dim=-1) <= bound).all()
        else:
            assert ((back - x).norm(dim=-1) <= 0.1 * x.norm(dim=-1)).all()


def test_the_rotation_keeps_outlier_channels_from_costing_the_other_scores():
    """int8 K rows with two channels 40x the others (the pattern of RoPE'd keys): one scale
    per row spends the codes on the outliers, so scores q . k of queries that read the other
    channels lose most of their precision; rotated first, the error is several times less.
    (fp8 keeps each value's relative precision, so this case favours it unrotated; on the
    default model's real keys the rotation helps fp8 too, docs/benchmarks.md#bench_kv_dtype.)"""
    dtype = torch.int8
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(512, 64, generator=gen)
    k[:, 5] *= 40
    k[:, 37] *= 40
    q = torch.randn(64, 64, generator=gen)
    q[:, [5, 37]] = 0.0
    exact = q @ k.T
    plain = kv_quant.quantize_rotated(k, dtype)  # one scale, no rotation
    err_plain = (q @ (plain[0].float() * plain[1][:, None]).T - exact).abs().mean()
    err_rot = (q @ kv_quant.dequantize(*kv_quant.quantize(k, dtype)).T - exact).abs().mean()
    assert err_rot * 3 < err_plain, (err_rot, err_plain)


def _pools(dtype, slots=260, hkv=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kq, ks, kf = _quantized((slots, hkv, dim), dtype, gen)
    vq, vs, vf = _quantized((slots, hkv, dim), dtype, gen)
    return gen, (kq, vq, ks, vs), (kf, vf)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0)])
def test_references_over_a_quantized_pool_are_their_float_paths_over_its_values(
        dtype, window, softcap):
    """Every reference path reads a quantized pool as stored, code * scale (rotated rows),
    with its query rotated in and its output rotated back: the same bits as the same path
    over that float32 pool so framed (decode with and without a shared prefix, extend, tree
    verify, masked), and within float rounding of the path over the dequantized rows."""
    gen, (kq, vq, ks, vs), (kd, vd) = _pools(dtype)
    kf, vf = kv_quant.rotated_values(kq, ks), kv_quant.rotated_values(vq, vs)

    def framed(path, q, *args, **kw):  # the float path over the rotated rows
        return kv_quant.output_for(path(kv_quant.query_for(q, dtype), kf, vf, *args, **kw),
                                   dtype)
    hq, dim, sm = 6, 64, 0.125
    quant = {"k_scale": ks, "v_scale": vs, "window": window, "softcap": softcap}
    plain = {"window": window, "softcap": softcap}
    table = torch.zeros(4, 200, dtype=torch.int32)
    perm = torch.randperm(259, generator=gen) + 1
    table[0, :120] = perm[:120].int()
    table[1, :60] = table[0, :60]  # shares a 60-slot prefix with row 0 (the cascade path)
    table[1, 60:100] = perm[120:160].int()
    table[2, :90] = perm[160:250].int()
    rows, lens = torch.tensor([0, 1, 2]), torch.tensor([120, 100, 90])
    q = torch.randn(3, hq, dim, generator=gen)
    got = reference.decode_attention(q, kq, vq, table, rows, lens, sm, **quant)
    assert torch.equal(got, framed(reference.decode_attention, q, table, rows, lens, sm,
                                   **plain))
    torch.testing.assert_close(got, reference.decode_attention(q, kd, vd, table, rows, lens, sm,
                                                               **plain), rtol=1e-4, atol=1e-4)
    prefix, extend = torch.tensor([0, 50, 20]), torch.tensor([30, 10, 70])
    qe = torch.randn(110, hq, dim, generator=gen)
    got = reference.extend_attention(qe, kq, vq, table, rows, prefix, extend, sm, **quant)
    assert torch.equal(got, framed(reference.extend_attention, qe, table, rows, prefix, extend,
                                   sm, **plain))
    tree = torch.ones(3, 4, 4, dtype=torch.bool).tril()
    tree[:, 3, 1] = False
    qt = torch.randn(12, hq, dim, generator=gen)
    pre = torch.tensor([80, 40, 60])
    got = reference.tree_verify_attention(qt, kq, vq, table, rows, pre, tree, sm, **quant)
    assert torch.equal(got, framed(reference.tree_verify_attention, qt, table, rows, pre, tree,
                                   sm, **plain))
    masks = [tree[0], torch.ones(1, 1, dtype=torch.bool), tree[2][:2, :2]]
    qm = torch.randn(7, hq, dim, generator=gen)
    got = reference.masked_attention(qm, kq, vq, table, rows, pre, masks, sm, **quant)
    assert torch.equal(got, framed(reference.masked_attention, qm, table, rows, pre, masks, sm,
                                   **plain))


def test_a_quantized_pool_without_its_scales_is_refused():
    _, (kq, vq, _, _), _ = _pools(torch.int8)
    q = torch.randn(1, 2, 64)
    table = torch.arange(10, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match="needs its scales"):
        reference.decode_attention(q, kq, vq, table, torch.tensor([0]), torch.tensor([10]), 1.0)


def test_store_kv_writes_codes_and_scales_of_its_slots_only():
    for dtype in QDTYPES:
        gen = torch.Generator().manual_seed(2)
        pool = KVPool(20, 1, 2, 64, dtype, "cpu")
        k_pool, v_pool, k_scale, v_scale = pool.layer(0)
        before = kv_quant.as_bytes(k_pool).clone(), k_scale.clone()
        k, v = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
        slots = torch.tensor([4, 9, 17])
        reference.store_kv(k_pool, v_pool, slots, k, v, k_scale, v_scale)
        codes, scale = kv_quant.quantize(k, dtype)
        assert torch.equal(kv_quant.as_bytes(k_pool[slots]), kv_quant.as_bytes(codes))
        assert torch.equal(k_scale[slots], scale)
        assert torch.equal(v_scale[slots], kv_quant.quantize(v, dtype)[1])
        others = torch.ones(21, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(kv_quant.as_bytes(k_pool)[others], before[0][others])
        # The pool is torch.empty: untouched scale rows may hold NaN bits, so compare bits.
        assert torch.equal(k_scale[others].view(torch.int32), before[1][others].view(torch.int32))


def test_pool_bytes_per_token_and_the_kv_cache_dtype_names():
    """int8 / fp8: one byte per element and a 4-byte scale per token and kv head, so the
    default model's 30 x 3 x 64 pool holds 128 / 68 = 1.88x the tokens of bf16 per byte."""
    bf16 = KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    assert bf16 == 2 * 30 * 3 * 64 * 2
    for dtype in QDTYPES:
        assert KVPool.bytes_per_token(30, 3, 64, dtype) == 2 * 30 * 3 * (64 + 4)
        pool = KVPool(8, 2, 3, 64, dtype, "cpu")
        assert pool.quantized and pool.bytes_per_slot == 2 * 2 * 3 * 68
        assert len(pool.k_scales) == 2 and pool.k_scales[0].shape == (9, 3)
        assert not pool.k_scales[0][0].any() and not kv_quant.as_bytes(pool.k_buffers[1][0]).any()
    assert KVPool(8, 1, 1, 64, torch.bfloat16, "cpu").k_scales is None
    names = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2, "fp8": torch.float8_e4m3fn,
             "float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
    for name, dtype in names.items():
        assert resolve_kv_cache_dtype(name, torch.float32) == dtype
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert {"int8", "fp8_e4m3", "fp8_e5m2"} <= set(KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match="int8, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int4", torch.bfloat16)
    # a resolved name round-trips through torch, as TP ranks read it
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        assert getattr(torch, str(dtype).removeprefix("torch.")) == dtype


def _edge_rows(dtype):
    """K rows whose largest value is QMAX, so the scale is exactly 1 and the codes are the
    cast of the values themselves: values across the fp8 range (subnormals, ties between two
    codes, negative zero) or int8 halves."""
    qmax = kv_quant.QMAX[dtype]
    gen = torch.Generator().manual_seed(4)
    if dtype == torch.int8:
        vals = torch.cat([torch.arange(-127, 128, dtype=torch.float32) + 0.5,
                          torch.randn(256, generator=gen) * 40])
    else:
        # every code's value, the midpoints between neighbours (ties to even), and randoms
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        codes = codes[codes.isfinite() & (codes.abs() <= qmax)].sort().values
        mids = (codes[1:] + codes[:-1]) / 2
        vals = torch.cat([codes, mids, torch.randn(256, generator=gen) * qmax / 8,
                          torch.tensor([-0.0])])
    vals = vals.clamp(-qmax, qmax)
    per_row = 63
    n = math.ceil(vals.numel() / per_row)
    vals = torch.cat([vals, torch.zeros(n * per_row - vals.numel())]).view(n, per_row)
    return torch.cat([torch.full((n, 1), qmax), vals], dim=1)  # [n, 64]


@needs_native
@pytest.mark.parametrize("dtype", QDTYPES)
def test_native_quantizer_is_torchs_bit_for_bit(dtype):
    """The native quantizer (attention.c's store) against kv_quant: on rotated rows at each
    format's rounding edges (ties between two codes, subnormals, negative zero), and on
    random rows of any magnitude through the rotation, for head sizes 64, 40 and 96."""
    edge = _edge_rows(dtype)
    codes, scale = ops.kv_quantize_rows(edge, dtype, rotated=True)
    want = kv_quant.quantize_rotated(edge, dtype)
    assert torch.equal(scale, want[1]) and (scale == 1).all()
    assert torch.equal(kv_quant.as_bytes(codes), kv_quant.as_bytes(want[0]))
    gen = torch.Generator().manual_seed(5)
    for dim in (64, 40, 96):
        x = torch.randn(300, dim, generator=gen) * torch.logspace(-4, 3, 300)[:, None]
        x[3] = 0.0
        codes, scale = ops.kv_quantize_rows(x, dtype)
        want = kv_quant.quantize(x, dtype)
        assert torch.equal(scale, want[1])
        assert torch.equal(kv_quant.as_bytes(codes), kv_quant.as_bytes(want[0]))


@needs_native
@pytest.mark.parametrize("dtype", QDTYPES)
def test_native_store_quantizes_as_torch_does_bit_for_bit(dtype):
    """decode_attention_rope without RoPE stores k and v as given: its codes and scales are
    kv_quant.quantize's, bit for bit, on random rows and on each format's edge values."""
    edge = _edge_rows(dtype)
    gen = torch.Generator().manual_seed(5)
    rand = torch.randn(edge.shape[0], 64, generator=gen) * torch.logspace(
        -4, 3, edge.shape[0])[:, None]
    b, hq, hkv, dim = edge.shape[0], 2, 2, 64
    k = torch.stack([edge, rand], dim=1)  # [b, 2, 64]
    v = torch.stack([rand.flip(0), -edge], dim=1)
    qkv = torch.cat([torch.randn(b, hq * dim, generator=gen), k.reshape(b, -1),
                     v.reshape(b, -1)], dim=1)
    pool = KVPool(b + 4, 1, hkv, dim, dtype, "cpu")
    k_pool, v_pool, k_scale, v_scale = pool.layer(0)
    slots = torch.randperm(b, generator=gen) + 1
    table = slots.int()[None]
    for i in range(b):  # one token a call, each attending to itself
        one = slice(i, i + 1)
        ops.decode_attention_rope(qkv[one], hq, hkv, dim, None, None, torch.tensor([0]), k_pool,
                                  v_pool, slots[one], table[:, i:], torch.tensor([0]),
                                  torch.tensor([1]), 0.125, torch.float32, k_scale=k_scale,
                                  v_scale=v_scale)
    for pool_t, scale_t, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        codes, scale = kv_quant.quantize(x, dtype)
        assert torch.equal(scale_t[slots], scale)
        assert torch.equal(kv_quant.as_bytes(pool_t[slots]), kv_quant.as_bytes(codes))


def _as_the_int8_kernel_reads(q, dtype):
    """q [..., D] as attention.c's int8 kernel scores with it (D a multiple of 16, <= 256):
    rotated (W S q / B), each head rounded to int16 with its own scale max|.| / 32767, so
    the reference over the same pool can be held to float rounding (a score of 300 moves by
    1e-3 with the int16 query, which the softmax of such scores shows)."""
    dim = q.shape[-1]
    if dtype != torch.int8 or dim % 16 or dim > 256:
        return q
    r = kv_quant.rotate(q) * (1.0 / kv_quant.block(dim))
    scale = r.abs().amax(-1, keepdim=True) / 32767
    q16 = (r / torch.where(scale > 0, scale, torch.ones_like(scale))).round()
    # the query whose rotation (query_for, in the reference) is r': S W r' (W S S W = B I)
    return kv_quant.rotate_back(q16 * scale) * kv_quant.block(dim)


def _native_case(dtype, dim, heads, gen):
    hkv, slots = heads[1], 400
    if dtype in QDTYPES:
        kq, ks, _ = _quantized((slots, hkv, dim), dtype, gen)
        vq, vs, _ = _quantized((slots, hkv, dim), dtype, gen)
    else:
        kq = torch.randn(slots, hkv, dim, generator=gen).to(dtype)
        vq = torch.randn(slots, hkv, dim, generator=gen).to(dtype)
        ks = vs = None
    table = torch.zeros(4, 1400, dtype=torch.int32)
    lens = [1, 37, 300]
    perm = torch.randperm(slots - 1, generator=gen) + 1
    rows = torch.tensor([2, 0, 3])
    start = 0
    for r, n in zip(rows.tolist(), lens, strict=True):
        table[r, :n] = perm[start:start + n].int()
        start += n
    return kq, vq, ks, vs, table, rows, torch.tensor(lens)


@needs_native
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("dim,heads", [(64, (9, 3)), (40, (10, 2))])
@pytest.mark.parametrize("window,softcap", [(None, None), (30, 15.0)])
def test_native_decode_attention_over_a_quantized_pool_is_the_reference(dtype, dim, heads,
                                                                         window, softcap):
    """RoPE + store + attention in one native call over an int8 / fp8 pool: the new rows'
    codes are the reference store's, and every query's output is the reference attention
    over the same pool (scores on the codes, then each key's scale)."""
    gen = torch.Generator().manual_seed(dim + heads[0])
    hq, hkv = heads
    kq, vq, ks, vs, table, rows, lens = _native_case(dtype, dim, heads, gen)
    rope = RotaryEmbedding(dim, 512, 10000.0, None, "cpu")
    positions = lens - 1
    out_slots = torch.stack([table[r, n - 1].long() for r, n in zip(rows, lens, strict=True)])
    qkv = torch.randn(3, (hq + 2 * hkv) * dim, generator=gen) * 3
    ref = [t.clone() for t in (kq, vq, ks, vs)]
    kw = {"window": window, "softcap": softcap}
    got = ops.decode_attention_rope(qkv, hq, hkv, dim, rope.cos_table, rope.sin_table,
                                    positions, kq, vq, out_slots, table, rows, lens, dim**-0.5,
                                    torch.float32, k_scale=ks, v_scale=vs, **kw)
    qk = qkv[:, :(hq + hkv) * dim].view(3, hq + hkv, dim)
    v = qkv[:, (hq + hkv) * dim:].view(3, hkv, dim)
    qk = rope.tables(positions).rotate(qk)
    reference.store_kv(ref[0], ref[1], out_slots, qk[:, hq:], v, ref[2], ref[3])
    assert torch.equal(kv_quant.as_bytes(vq), kv_quant.as_bytes(ref[1]))
    assert torch.equal(vs, ref[3])
    # K went through RoPE on each side (last-bit differences): codes within one step
    diff = (kq.float() - ref[0].float()).abs()
    assert (diff > 0).sum() <= diff.numel() // 100
    q = _as_the_int8_kernel_reads(qk[:, :hq].contiguous(), dtype)
    want = reference.decode_attention(q, kq, vq, table, rows, lens, dim**-0.5, k_scale=ks,
                                      v_scale=vs, **kw)
    # values reach 10 (rows of 0.01 to 10): float32 sums in another order, relative to them
    torch.testing.assert_close(got.view(3, hq, dim), want, rtol=2e-5,
                               atol=5e-6 * want.abs().max().item())


@needs_native
@pytest.mark.parametrize("dtype", QDTYPES)
def test_native_rows_sharing_a_long_prefix_are_each_rows_own_bits(dtype):
    """1,500 shared keys (read by chunk, rows grouped): each row of a verify over a quantized
    pool is the bits of that row alone, and the reference attention."""
    hq, hkv, dim, n_rows, prefix = 9, 3, 64, 4, 1500
    gen = torch.Generator().manual_seed(11)
    kq, ks, _ = _quantized((1600, hkv, dim), dtype, gen)
    vq, vs, _ = _quantized((1600, hkv, dim), dtype, gen)
    perm = (torch.randperm(1599, generator=gen) + 1).int()
    table = torch.zeros(n_rows + 1, prefix + n_rows, dtype=torch.int32)
    for i in range(n_rows):
        table[i + 1, :prefix] = perm[:prefix]
        table[i + 1, prefix:prefix + i + 1] = perm[prefix:prefix + i + 1]
    rows = torch.arange(1, n_rows + 1)
    lens = torch.tensor([prefix + i + 1 for i in range(n_rows)])
    qkv = torch.randn(n_rows, (hq + 2 * hkv) * dim, generator=gen)
    args = (hq, hkv, dim, None, None)
    out_slots = perm[prefix:prefix + n_rows].long()
    together = ops.decode_attention_rope(qkv, *args, lens - 1, kq, vq, out_slots, table, rows,
                                         lens, dim**-0.5, torch.float32, k_scale=ks, v_scale=vs)
    for i in range(n_rows):
        one = slice(i, i + 1)
        alone = ops.decode_attention_rope(qkv[one], *args, lens[one] - 1, kq, vq,
                                          out_slots[one], table, rows[one], lens[one],
                                          dim**-0.5, torch.float32, k_scale=ks, v_scale=vs)
        assert torch.equal(alone[0], together[i]), i
    q = _as_the_int8_kernel_reads(qkv[:, :hq * dim].reshape(n_rows, hq, dim), dtype)
    want = reference.decode_attention(q, kq, vq, table, rows, lens, dim**-0.5, k_scale=ks,
                                      v_scale=vs)
    torch.testing.assert_close(together.view(n_rows, hq, dim), want, rtol=2e-5,
                               atol=5e-6 * want.abs().max().item())


@needs_native
def test_native_refuses_a_quantized_pool_without_scales():
    kq, vq, ks, _, table, rows, lens = _native_case(torch.int8, 64, (2, 2), torch.Generator())
    qkv = torch.randn(3, 6 * 64)
    with pytest.raises(TypeError, match="needs v_scale"):
        ops.decode_attention_rope(qkv, 2, 2, 64, None, None, lens - 1, kq, vq, lens, table,
                                  rows, lens, 0.125, torch.float32, k_scale=ks)
    with pytest.raises(TypeError, match="float32, bfloat16, int8 or fp8"):
        ops.decode_attention_rope(qkv, 2, 2, 64, None, None, lens - 1, kq.half(), vq.half(),
                                  lens, table, rows, lens, 0.125, torch.float32)


@needs_native
@pytest.mark.parametrize("variant", kc.supported_isas())
@pytest.mark.parametrize("dtype", QDTYPES)
def test_fused_decode_step_over_a_quantized_pool_is_the_per_op_calls_bit_for_bit(variant,
                                                                                  dtype):
    """decode_step.c's one call over int8 / fp8 pools: the residual stream and the codes and
    scales it writes are the per-op calls' bits (the same attention.c code)."""
    layers, hidden, hq, hkv, dim, inter, eps, t = 2, 64, 4, 2, 16, 96, 1e-5, 3
    gen = torch.Generator().manual_seed(3)
    nqkv = (hq + 2 * hkv) * dim

    def packed(n, k):
        return kc.q4_x16_pack(q4_1_blocks(torch.randn(n, k, generator=gen) * 0.1), n, k)

    weights = [[packed(nqkv, hidden), packed(hidden, hq * dim), packed(2 * inter, hidden),
                packed(hidden, inter)] for _ in range(layers)]
    norms = [[torch.rand(hidden, generator=gen) + 0.5 for _ in range(2)] for _ in range(layers)]
    pool = KVPool(700, layers, hkv, dim, dtype, "cpu")
    for i in range(layers):
        k, v, ks, vs = pool.layer(i)
        reference.store_kv(k, v, torch.arange(701), torch.randn(701, hkv, dim, generator=gen),
                           torch.randn(701, hkv, dim, generator=gen), ks, vs)
    ref = [[x.clone() for x in pool.layer(i)] for i in range(layers)]
    rope = RotaryEmbedding(dim, 512, 10000.0, None, "cpu")
    lens = [1, 37, 300]
    table = torch.zeros(t + 1, 320, dtype=torch.int32)
    rows = torch.arange(t, 0, -1)
    for r, n in zip(rows.tolist(), lens, strict=True):
        table[r, :n] = (torch.randperm(700, generator=gen)[:n] + 1).int()
    seq_lens = torch.tensor(lens)
    positions = seq_lens - 1
    out_slots = torch.stack([table[r, n - 1].long() for r, n in zip(rows, lens, strict=True)])
    x0 = torch.randn(t, hidden, generator=gen)
    x, f32 = x0.clone(), torch.float32
    h = ops.rmsnorm(x, norms[0][0], eps, f32)
    for i, (w_qkv, w_o, w_gu, w_down) in enumerate(weights):
        k, v, ks, vs = ref[i]
        a = ops.decode_attention_rope(kc.q4_x16_matmul(h, w_qkv, nqkv, variant), hq, hkv, dim,
                                      rope.cos_table, rope.sin_table, positions, k, v,
                                      out_slots, table, rows, seq_lens, dim**-0.5, f32,
                                      k_scale=ks, v_scale=vs)
        x, h = ops.add_rmsnorm(x, kc.q4_x16_matmul(a, w_o, hidden, variant), norms[i][1], eps,
                               f32)
        down = kc.q4_x16_matmul(ops.silu_mul(kc.q4_x16_matmul(h, w_gu, 2 * inter, variant), f32),
                                w_down, hidden, variant)
        if i + 1 < layers:
            x, h = ops.add_rmsnorm(x, down, norms[i + 1][0], eps, f32)
        else:
            x = x + down
    ptrs = torch.tensor([[*(w.data_ptr() for w in weights[i]), norms[i][0].data_ptr(),
                          norms[i][1].data_ptr(), pool.k_buffers[i].data_ptr(),
                          pool.v_buffers[i].data_ptr(), 0, 0, 0, 0, 0, 0] for i in range(layers)],
                        dtype=torch.int64)
    scales = torch.tensor([[pool.k_scales[i].data_ptr(), pool.v_scales[i].data_ptr()]
                           for i in range(layers)], dtype=torch.int64)
    got = x0.clone()
    step = (layers, got, ptrs, eps, dtype, rope.cos_table, rope.sin_table, positions, out_slots,
            table, rows, seq_lens, hq, hkv, dim, inter, dim**-0.5, torch.tensor([-1, -1]), None,
            variant)
    with pytest.raises(ValueError, match="needs kv_scales"):
        ops.decode_step_x16(*step)
    ops.decode_step_x16(*step, kv_scales=scales)
    assert torch.equal(got, x)
    for i in range(layers):
        for a, b in zip(pool.layer(i), ref[i], strict=True):
            assert torch.equal(kv_quant.as_bytes(a), kv_quant.as_bytes(b))


@needs_native
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
def test_int8_long_context_reads_every_head_in_one_pass_with_the_same_bits(heads):
    """A batch with a context long enough to be read by chunk (4,401 keys: so on up to 8
    threads) runs the int8 pool
    through one pass over all kv heads a chunk (attention.c's attend_i8_all_*); a short row in
    that batch is then the bits it has alone (read head by head), and the long row is the
    reference's."""
    hq, hkv, dim = *heads, 64
    gen = torch.Generator().manual_seed(hq + hkv)
    kq, ks, _ = _quantized((4600, hkv, dim), torch.int8, gen)
    vq, vs, _ = _quantized((4600, hkv, dim), torch.int8, gen)
    perm = (torch.randperm(4599, generator=gen) + 1).int()
    lens = torch.tensor([4401, 90])  # a tail of keys past the last multiple of 8 too
    table = torch.zeros(2, 4401, dtype=torch.int32)
    table[0] = perm[:4401]
    table[1, :90] = perm[4401:4491]
    rows = torch.arange(2)
    qkv = torch.randn(2, (hq + 2 * hkv) * dim, generator=gen)
    out_slots = torch.stack([table[0, 4400], table[1, 89]]).long()
    args = (hq, hkv, dim, None, None)
    both = ops.decode_attention_rope(qkv, *args, lens - 1, kq, vq, out_slots, table, rows, lens,
                                     dim**-0.5, torch.float32, k_scale=ks, v_scale=vs)
    short = ops.decode_attention_rope(qkv[1:], *args, lens[1:] - 1, kq, vq, out_slots[1:],
                                      table, rows[1:], lens[1:], dim**-0.5, torch.float32,
                                      k_scale=ks, v_scale=vs)
    assert torch.equal(both[1], short[0])
    q = _as_the_int8_kernel_reads(qkv[:, :hq * dim].reshape(2, hq, dim), torch.int8)
    want = reference.decode_attention(q, kq, vq, table, rows, lens, dim**-0.5, k_scale=ks,
                                      v_scale=vs)
    torch.testing.assert_close(both.view(2, hq, dim), want, rtol=2e-5,
                               atol=5e-6 * want.abs().max().item())
