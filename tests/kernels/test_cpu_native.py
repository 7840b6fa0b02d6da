"""The native CPU kernels (kernels/sglang_like_kernels/cpu) against torch math, on every variant
this CPU runs.

A machine with AVX-512 VNNI runs both builds (the AVX2 one too), so one session's tests cover
the code an AVX2-only machine would run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import sglang_like_kernels.cpu as kc
from sglang_like.layers.quantization import q4_1_blocks
from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight
from sglang_like.layers.quantization.int8 import quantize_blocks_int8
from sglang_like.layers.rotary import RotaryEmbedding
from sglang_like_kernels import reference
from sglang_like_kernels.cpu import ops

pytestmark = pytest.mark.skipif(not kc.available(), reason="needs a C compiler and AVX2")
VARIANTS = kc.supported_isas()


def _blocks_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q4_1 blocks, the float matrix they hold) for a dense matrix."""
    blocks = q4_1_blocks(w)
    return blocks, kc.q4_1_dequantize(blocks, w.shape[0], w.shape[1])


def _q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the Q4_1 kernel computes: x rounded to int8 per block of 32 (scale amax / 127),
    then multiplied by the Q4_1 matrix in float64."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    scale = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(xb / torch.where(scale > 0, scale, torch.ones_like(scale)))
    return ((q * scale).view(m, k) @ w.double().T).float()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13])
def test_q4_1_matmul_is_int8_activations_times_the_blocks(variant, m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(80, 192, generator=gen) * 0.05
    blocks, wq = _blocks_of(w)
    x = torch.randn(m, 192, generator=gen)
    y = kc.q4_1_matmul(x, blocks, 80, variant)
    torch.testing.assert_close(y, _q8_reference(x, wq), rtol=1e-4, atol=1e-4)
    # and close to the float product: the int8 rounding of activations is all it adds
    exact = x @ wq.T
    assert ((y - exact).norm() / exact.norm()).item() < 0.01


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_1_matmul_invariant_rows_are_the_same_bits_in_any_batch(variant):
    """`invariant` (deterministic inference): a lone row gives the bits it gets in a batch of
    any size; without it a lone row takes the two-accumulator path, whose sums differ."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 576, generator=gen) * 0.05
    blocks, _ = _blocks_of(w)
    x = torch.randn(9, 576, generator=gen) * torch.logspace(-2, 2, 9).unsqueeze(1)
    batch = kc.q4_1_matmul(x, blocks, 96, variant, invariant=True)
    for m in (1, 2, 4, 5, 9):
        part = kc.q4_1_matmul(x[:m], blocks, 96, variant, invariant=True)
        assert torch.equal(part, batch[:m]), m
    for r in range(9):
        assert torch.equal(kc.q4_1_matmul(x[r:r + 1], blocks, 96, variant, invariant=True),
                           batch[r:r + 1]), r
    assert not torch.equal(kc.q4_1_matmul(x[:1], blocks, 96, variant), batch[:1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_1_matmul_reads_strided_rows_and_refuses_bad_k(variant):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=gen)
    blocks, wq = _blocks_of(w)
    wide = torch.randn(4, 96, generator=gen)
    x = wide[:, 16:80]  # rows with a stride of 96
    torch.testing.assert_close(kc.q4_1_matmul(x, blocks, 32, variant), _q8_reference(x, wq),
                               rtol=1e-4, atol=1e-4)
    assert kc.q4_1_matmul(torch.empty(0, 64), blocks, 32, variant).shape == (0, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kc.q4_1_matmul(torch.randn(1, 48), blocks, 32, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 13, 17, 33])
def test_q4_x16_matmul_is_the_q4_1_kernels_numbers_in_any_batch(variant, m):
    """The x16 layout holds the same blocks: its product is q4_1_matmul's (the same int8
    activations; sums in another order), and a row's result is the same bits alone and in a
    batch of m (passes of up to 8 / 4 rows, so 9, 13, 17 and 33 cross pass boundaries)."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(96, 576, generator=gen) * 0.05
    blocks, wq = _blocks_of(w)
    packed = kc.q4_x16_pack(blocks, 96, 576, variant)
    assert packed.numel() == blocks.numel()  # 20 bytes per 32 weights, as Q4_1
    assert torch.equal(kc.q4_x16_dequantize(packed, 96, 576, variant), wq)
    x = torch.randn(m, 576, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1)
    y = kc.q4_x16_matmul(x, packed, 96, variant)
    torch.testing.assert_close(y, kc.q4_1_matmul(x, blocks, 96, variant), rtol=1e-5,
                               atol=1e-5 * x.abs().max())
    exact = x @ wq.T
    assert ((y - exact).norm() / exact.norm()).item() < 0.01
    for r in range(m):
        assert torch.equal(kc.q4_x16_matmul(x[r:r + 1], packed, 96, variant), y[r:r + 1]), r
    wide = torch.randn(m, 640, generator=gen)
    strided = wide[:, 32:608]  # rows with a stride of 640
    torch.testing.assert_close(kc.q4_x16_matmul(strided, packed, 96, variant),
                               kc.q4_1_matmul(strided, blocks, 96, variant), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_x16_refuses_shapes_it_cannot_hold(variant):
    blocks, _ = _blocks_of(torch.randn(40, 64))
    with pytest.raises(ValueError, match="N % 16"):
        kc.q4_x16_pack(blocks, 40, 64, variant)
    packed = kc.q4_x16_pack(*_blocks_of(torch.randn(32, 64))[:1], 32, 64, variant)
    assert kc.q4_x16_matmul(torch.empty(0, 64), packed, 32, variant).shape == (0, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kc.q4_x16_matmul(torch.randn(1, 48), packed, 32, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 4, 9, 33])
def test_q8_x16_head_is_int8_activations_times_the_rows(variant, m):
    """The LM head's x16 layout (q8_rows.c): the same block-int8 rows (gathered back out of
    it exactly), multiplied with activations in two int8 parts per 32 columns (about 15
    bits: logits within 1e-4 of the float product's norm); a row's logits are the same bits
    alone and in a batch."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(96, 576, generator=gen) * 0.05
    codes, scales = quantize_blocks_int8(w)
    codes[0, :32] = torch.arange(-128, 128, 8, dtype=torch.int8)  # the extremes too
    packed, pscales = kc.q8_x16_pack(codes, scales)
    ids = torch.tensor([0, 15, 16, 95, 7])
    got_codes, got_scales = kc.q8_x16_rows(packed, pscales, ids)
    assert torch.equal(got_codes, codes[ids]) and torch.equal(got_scales, scales[ids])
    wq = (codes.double().view(96, 18, 32) * scales.double().unsqueeze(-1)).view(96, 576)
    x = torch.randn(m, 576, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1)
    y = kc.q8_x16_matmul(x, packed, pscales, variant)
    exact = x.double() @ wq.T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-4
    for r in range(m):
        assert torch.equal(kc.q8_x16_matmul(x[r:r + 1], packed, pscales, variant), y[r:r + 1])


def _gguf_tensor(name: str) -> GGUFBlockWeight:
    from sglang_like.model_loader import default_model_path

    t = next(t for t in gguf.GGUFReader(default_model_path()).tensors if t.name == name)
    rows, cols = int(t.shape[1]), int(t.shape[0])
    return GGUFBlockWeight(t.tensor_type.name, (rows, cols), np.array(t.data).reshape(rows, -1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantize_equals_gguf_on_the_default_model(variant):
    source = _gguf_tensor("blk.3.ffn_down.weight")
    assert source.qtype == "Q4_1"
    blocks = q4_1_blocks(source)
    got = kc.q4_1_dequantize(blocks, *source.shape, variant)
    assert torch.equal(got, source.dequantize())


def test_q4_0_and_dense_sources_become_q4_1_blocks():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=gen)
    q4_0 = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    source = GGUFBlockWeight("Q4_0", (16, 64), q4_0)
    assert torch.equal(kc.q4_1_dequantize(q4_1_blocks(source), 16, 64), source.dequantize())
    # a dense matrix: within half a step of its block's scale everywhere
    blocks, wq = _blocks_of(w)
    d = blocks.view(16, 2, 20)[..., 0:2].contiguous().view(torch.float16).float()
    step = d.repeat_interleave(32, dim=1).view(16, 64)
    assert ((wq - w).abs() <= step / 2 + 1e-3).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 3, 4, 7, 9, 17, 33])
def test_q8_0_head_keeps_float_activations(variant, m):
    gen = torch.Generator().manual_seed(11)
    # 301 weight rows: a tile of 64 left partial, and a last pair of rows left single
    w = torch.randn(301, 128, generator=gen) * 0.1
    codes, scale = quantize_blocks_int8(w)
    wq = (codes.float().view(301, 4, 32) * scale[..., None]).view(301, 128)
    x = torch.randn(m, 128, generator=gen)
    y = kc.q8_0_matmul_f32(x, codes, scale, variant)
    torch.testing.assert_close(y, x @ wq.T, rtol=1e-5, atol=1e-5)
    # rows go through in chunks of up to 8 (AVX-512) or 4 (AVX2): each row's logits are the
    # bits it gets alone (a verify pass's rows equal the one-row decode step's)
    alone = torch.cat([kc.q8_0_matmul_f32(x[i : i + 1], codes, scale, variant)
                       for i in range(m)])
    assert torch.equal(y, alone)


def _rmsnorm(x, w, eps):
    xf = x.float()
    inv = torch.mean(xf * xf, dim=-1, keepdim=True).add_(eps).rsqrt_()
    return torch.mul(xf, inv).mul_(w)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm(out_dtype):
    gen = torch.Generator().manual_seed(2)
    x, d = torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen)
    w = torch.rand(576, generator=gen) + 0.5
    x_new, h = ops.add_rmsnorm(x, d, w, 1e-5, out_dtype)
    assert torch.equal(x_new, x + d) and h.dtype == out_dtype
    want = _rmsnorm(x + d, w, 1e-5)
    tol = 1e-5 if out_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(h.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-5, torch.float32), _rmsnorm(x, w, 1e-5),
                               rtol=1e-5, atol=1e-5)
    # a bf16 delta (an int kernel's output) is widened exactly before the add
    x_b, h_b = ops.add_rmsnorm(x, d.bfloat16(), w, 1e-5, out_dtype)
    assert torch.equal(x_b, x + d.bfloat16().float())
    torch.testing.assert_close(h_b.float(), _rmsnorm(x_b, w, 1e-5), rtol=tol, atol=tol)
    # bf16 rounding is torch's (round to nearest even) on the same float value
    assert torch.equal(ops.rmsnorm(x, w, 1e-5, torch.bfloat16),
                       ops.rmsnorm(x, w, 1e-5, torch.float32).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * 100, generator=gen) * 4).to(dtype)  # 100: a scalar tail
    got = ops.silu_mul(gate_up, torch.float32)
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(g) * u, rtol=2e-6, atol=2e-6)
    assert ops.silu_mul(gate_up, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 32, 40])  # 40: not a multiple of 32, a head at a time
@pytest.mark.parametrize("heads", [(9, 3), (10, 2)])  # 10 / 2: groups of 5, in sets of 4 + 1
def test_decode_attention_rope_matches_rope_store_and_reference_attention(pool_dtype,
                                                                          act_dtype, dim, heads):
    (hq, hkv), slots = heads, 400
    gen = torch.Generator().manual_seed(8)
    rope = RotaryEmbedding(dim, 512, 10000.0, None, "cpu")
    k_pool = torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)
    v_pool = torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)
    req_to_token = torch.zeros(4, 320, dtype=torch.int32)
    lens = [1, 37, 300]  # a first token, a short request, and one of two key chunks + a tail
    perm = torch.randperm(slots - 1, generator=gen) + 1
    rows = torch.tensor([2, 0, 3])
    start = 0
    for r, n in zip(rows.tolist(), lens, strict=True):
        req_to_token[r, :n] = perm[start:start + n].int()
        start += n
    seq_lens = torch.tensor(lens)
    positions = seq_lens - 1
    out_slots = torch.stack([req_to_token[r, n - 1].long() for r, n in zip(rows, lens,
                                                                          strict=True)])
    qkv = torch.randn(3, (hq + 2 * hkv) * dim, generator=gen).to(act_dtype)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    got = ops.decode_attention_rope(qkv, hq, hkv, dim, rope.cos_table, rope.sin_table, positions,
                                    k_pool, v_pool, out_slots, req_to_token, rows, seq_lens,
                                    dim**-0.5, torch.float32)
    # the torch path: RoPE, store, attend
    qk = qkv.float()[:, :(hq + hkv) * dim].view(3, hq + hkv, dim)
    v = qkv.float()[:, (hq + hkv) * dim:].view(3, hkv, dim)
    qk = rope.tables(positions).rotate(qk)
    reference.store_kv(k_ref, v_ref, out_slots, qk[:, hq:], v)
    assert torch.equal(k_pool, k_ref) if pool_dtype == torch.bfloat16 else torch.allclose(
        k_pool, k_ref, atol=1e-6)
    assert torch.equal(v_pool, v_ref)
    want = reference.decode_attention(qk[:, :hq].contiguous(), k_ref, v_ref, req_to_token, rows,
                                      seq_lens, dim**-0.5)
    torch.testing.assert_close(got.view(3, hq, dim), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("prefix", [200, 1500])  # 1500: a long row, read by chunk (grouped)
def test_decode_attention_rows_sharing_a_prefix_are_each_rows_own_bits(prefix):
    """A verify's rows (one request's prefix, then each row's own tree nodes) share work items
    and read the shared keys once (attention.c groups them): every row's output is the same
    bits as that row attended alone, and close to the reference attention."""
    hq, hkv, dim, n_rows, slots = 9, 3, 64, 6, 1600
    gen = torch.Generator().manual_seed(11)
    rope = RotaryEmbedding(dim, 2048, 10000.0, None, "cpu")
    k_pool = torch.randn(slots, hkv, dim, generator=gen).bfloat16()
    v_pool = torch.randn(slots, hkv, dim, generator=gen).bfloat16()
    perm = (torch.randperm(slots - 1, generator=gen) + 1).int()
    shared, nodes = perm[:prefix], perm[prefix:prefix + n_rows]
    # a tree: row i sees the prefix, then the nodes on its path (0 and every odd one up to i)
    paths = [[j for j in range(i + 1) if j == 0 or j % 2 == 1 or j == i] for i in range(n_rows)]
    table = torch.zeros(n_rows + 1, prefix + n_rows, dtype=torch.int32)
    for i, path in enumerate(paths):
        table[i + 1, :prefix] = shared
        table[i + 1, prefix:prefix + len(path)] = nodes[path]
    rows = torch.arange(1, n_rows + 1)
    seq_lens = torch.tensor([prefix + len(p) for p in paths])
    positions = torch.tensor([prefix + len(p) - 1 for p in paths])
    out_slots = nodes.long()
    qkv = torch.randn(n_rows, (hq + 2 * hkv) * dim, generator=gen)
    args = (hq, hkv, dim, rope.cos_table, rope.sin_table)
    together = ops.decode_attention_rope(qkv, *args, positions, k_pool, v_pool, out_slots, table,
                                         rows, seq_lens, dim**-0.5, torch.float32)
    for i in range(n_rows):
        one = slice(i, i + 1)
        alone = ops.decode_attention_rope(qkv[one], *args, positions[one], k_pool, v_pool,
                                          out_slots[one], table, rows[one], seq_lens[one],
                                          dim**-0.5, torch.float32)
        assert torch.equal(alone[0], together[i]), f"row {i}"
    qk = qkv[:, : (hq + hkv) * dim].reshape(n_rows, hq + hkv, dim)
    qk = rope.tables(positions).rotate(qk)
    want = reference.decode_attention(qk[:, :hq].contiguous(), k_pool, v_pool, table, rows,
                                      seq_lens, dim**-0.5)
    torch.testing.assert_close(together.view(n_rows, hq, dim), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 11])  # 11: more rows than one x16 pass holds
def test_decode_step_x16_is_the_per_op_calls_bit_for_bit(variant, pool_dtype, t):
    """The fused step (decode_step.c: every layer in one call) against the per-op calls it
    replaces (norms, x16 matmuls, RoPE + store + attention, silu): the same residual stream,
    the same captured features and the same K/V written, bit for bit, on each build (the
    norms, RoPE and attention are the same plain C in both, no FMA contraction)."""
    layers, hidden, hq, hkv, dim, inter, eps = 2, 64, 4, 2, 16, 96, 1e-5
    gen = torch.Generator().manual_seed(3)
    nqkv = (hq + 2 * hkv) * dim

    def packed(n, k):
        w = torch.randn(n, k, generator=gen) * 0.1
        return kc.q4_x16_pack(q4_1_blocks(w), n, k)

    weights = [[packed(nqkv, hidden), packed(hidden, hq * dim), packed(2 * inter, hidden),
                packed(hidden, inter)] for _ in range(layers)]
    norms = [[torch.rand(hidden, generator=gen) + 0.5 for _ in range(2)] for _ in range(layers)]
    slots = 700
    pools = [(torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype),
              torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)) for _ in range(layers)]
    rope = RotaryEmbedding(dim, 512, 10000.0, None, "cpu")
    lens = [(1, 37, 300)[i % 3] + i for i in range(t)]  # a chunk of 256 keys and a tail too
    table = torch.zeros(t + 1, 320, dtype=torch.int32)
    perm = torch.randperm(slots - 1, generator=gen) + 1
    rows = torch.arange(t, 0, -1)
    for r, n in zip(rows.tolist(), lens, strict=True):
        table[r, :n] = perm[torch.randperm(slots - 1, generator=gen)[:n]].int()
    seq_lens = torch.tensor(lens)
    positions = seq_lens - 1
    out_slots = torch.stack([table[r, n - 1].long() for r, n in zip(rows, lens, strict=True)])
    x0 = torch.randn(t, hidden, generator=gen)

    # the per-op calls (native_decode.NativeDecodePlan.run without the fused step)
    ref_pools = [(k.clone(), v.clone()) for k, v in pools]
    x, f32 = x0.clone(), torch.float32
    h = ops.rmsnorm(x, norms[0][0], eps, f32)
    aux_want = None
    for i, (w_qkv, w_o, w_gu, w_down) in enumerate(weights):
        if i == 1:
            aux_want = x.clone()
        a = ops.decode_attention_rope(kc.q4_x16_matmul(h, w_qkv, nqkv, variant), hq, hkv, dim,
                                      rope.cos_table, rope.sin_table, positions, *ref_pools[i],
                                      out_slots, table, rows, seq_lens, dim**-0.5, f32)
        x, h = ops.add_rmsnorm(x, kc.q4_x16_matmul(a, w_o, hidden, variant), norms[i][1], eps, f32)
        act = ops.silu_mul(kc.q4_x16_matmul(h, w_gu, 2 * inter, variant), f32)
        down = kc.q4_x16_matmul(act, w_down, hidden, variant)
        if i + 1 < layers:
            x, h = ops.add_rmsnorm(x, down, norms[i + 1][0], eps, f32)
        else:
            x = x + down

    ptrs = torch.tensor([[*(w.data_ptr() for w in weights[i]), norms[i][0].data_ptr(),
                          norms[i][1].data_ptr(), pools[i][0].data_ptr(), pools[i][1].data_ptr(),
                          0, 0, 0, 0, 0, 0]  # a Llama layer: no output or q/k norms, no biases
                         for i in range(layers)], dtype=torch.int64)
    got, features = x0.clone(), torch.empty(t, hidden)
    ops.decode_step_x16(layers, got, ptrs, eps, pool_dtype, rope.cos_table, rope.sin_table,
                        positions, out_slots, table, rows, seq_lens, hq, hkv, dim, inter,
                        dim**-0.5, torch.tensor([-1, 0]), features, variant)
    assert torch.equal(got, x)
    assert torch.equal(features, aux_want)
    for (k, v), (k_ref, v_ref) in zip(pools, ref_pools, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    with pytest.raises(ValueError, match="cannot take these shapes"):
        ops.decode_step_x16(layers, got, ptrs, eps, pool_dtype, rope.cos_table, rope.sin_table,
                            positions, out_slots, table, rows, seq_lens, hq, hkv, dim, 40,
                            dim**-0.5, torch.tensor([-1, -1]), None)


def test_env_var_turns_the_kernels_off_and_rejects_unknown_values():
    code = ("import sglang_like_kernels.cpu as kc, torch;"
            "from sglang_like.layers.quantization import QuantConfig;"
            "print(kc.available(), kc.isa())")
    env = {**os.environ, "SGLANG_LIKE_CPU_KERNELS": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "None"]
    env["SGLANG_LIKE_CPU_KERNELS"] = "sse9"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "SGLANG_LIKE_CPU_KERNELS='sse9'" in proc.stderr


def test_the_build_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_LIKE_CACHE_DIR", str(tmp_path))
    first = kc._build("avx2")
    mtime = first.stat().st_mtime_ns
    assert kc._build("avx2") == first and first.stat().st_mtime_ns == mtime
    assert first.parent == tmp_path / "kernels" and list(first.parent.glob("*.so")) == [first]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 49152, 49157])
def test_argmax_rows_is_torchs_argmax(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = -float("inf")  # every value equal: the first
    x[2, n // 2] = x[2, n - 1] = 1e9  # a tie: the first of the two
    x[3] = x[3].round()  # many ties of small integers
    if n > 3:
        x[4, 1] = x[4, 3] = float("nan")  # NaN counts as the maximum: the first NaN
    x[5, :] = -0.0
    x[5, n - 1] = 0.0  # -0.0 == 0.0: the first
    want = x.argmax(dim=-1).tolist()
    assert ops.argmax_rows(x) == want
    # rows of a wider matrix (a row stride), as the sampler's views are
    wide = torch.full((6, n + 5), 5e9)
    wide[:, :n] = x
    assert ops.argmax_rows(wide[:, :n]) == want
    assert ops.argmax_rows(x[:0]) == []
    with pytest.raises(TypeError):
        ops.argmax_rows(x.double())


@pytest.mark.parametrize("variant", VARIANTS)
def test_q8_x16_argmax_is_the_argmax_of_the_full_logits(variant):
    """Greedy rows (q8_x16_argmax): the index argmax_rows gives over q8_x16_matmul's logits
    (first among equals, NaN as the maximum), the second activation part computed only for
    the 16-row groups that can win. AVX-512 VNNI only: the AVX2 build refuses."""
    gen = torch.Generator().manual_seed(7)
    n = 1024
    w = torch.randn(n, 576, generator=gen) * 0.05
    w[700] = w[300]  # an exact tie: the lower index wins
    w[301] = w[300]
    w[301, 5] -= 0.004 * torch.sign(w[300, 5])  # a near one: a code apart, a little below
    codes, scales = quantize_blocks_int8(w)
    for r in range(340, 1000, 40):  # copies a code or two apart, in other groups: near ties
        codes[r], scales[r] = codes[300], scales[300]  # that the second part orders
        at = torch.randint(0, 576, (2,), generator=gen)
        codes[r, at] = (codes[r, at].int() + torch.tensor([1, -1])).clamp(-127, 127).to(torch.int8)
    packed, pscales = kc.q8_x16_pack(codes, scales)
    bounds = kc.q8_x16_row_bounds(packed, pscales)
    wq = (codes.double().view(n, 18, 32) * scales.double().unsqueeze(-1)).view(n, 576)
    per_block = wq.abs().view(n, 18, 32).sum(-1)  # each block's sum |w|: the largest bounds
    assert torch.equal(bounds >= per_block.amax(1).float(), torch.ones(n, dtype=torch.bool))
    if variant != "avx512_vnni":
        with pytest.raises(NotImplementedError):
            kc.q8_x16_argmax(torch.randn(1, 576), packed, pscales, bounds, variant)
        return
    rows = [torch.randn(40, 576, generator=gen) * torch.logspace(-3, 2, 40).unsqueeze(1)]
    rows.append(w[300:301] * 40)  # 300 or a near copy wins; never 700, its exact copy
    rows.append(w[300] * 40 + torch.randn(24, 576, generator=gen))  # near ties among the copies
    rows.append(torch.zeros(1, 576))  # every logit 0: index 0 (row 65)
    x = torch.cat(rows)
    ids, exact = kc.q8_x16_argmax(x, packed, pscales, bounds, variant)
    full = kc.q8_x16_matmul(x, packed, pscales, variant)
    assert ids.tolist() == ops.argmax_rows(full)
    assert ids[40].item() != 700 and ids[65].item() == 0  # a copy never beats its twin
    assert exact < x.shape[0] * n // 16  # most groups were left at one part
    for r in (0, 39, 40):  # a row's answer does not depend on the batch
        assert kc.q8_x16_argmax(x[r:r + 1], packed, pscales, bounds, variant)[0].item() == ids[r]
    scales[37, 3] = float("nan")  # a broken row: NaN logits everywhere it is, the maximum
    packed, pscales = kc.q8_x16_pack(codes, scales)
    ids, _ = kc.q8_x16_argmax(x[:3], packed, pscales, bounds, variant)
    assert ids.tolist() == ops.argmax_rows(kc.q8_x16_matmul(x[:3], packed, pscales, variant))
    assert ids.tolist() == [37, 37, 37]


@pytest.mark.skipif("avx512_vnni" not in VARIANTS, reason="the argmax is AVX-512 VNNI's")
def test_q8_x16_argmax_first_pass_on_the_tiles():
    """On AMX CPUs the greedy head's first pass (every logit's first part, bounding which
    groups can hold the maximum) runs on the tiles from 8 rows: the same integer dots and
    float steps, so the same bounds: the same groups computed in full and the same ids, over
    66 rows (four full tiles and one of 2), 17 and 8, with near ties and a NaN row."""
    from sglang_like_kernels.cpu import amx

    if not amx.available():
        pytest.skip("this CPU has no AMX tiles")
    gen = torch.Generator().manual_seed(8)
    n = 1024
    w = torch.randn(n, 576, generator=gen) * 0.05
    for r in range(340, 1000, 40):  # near copies of row 300 in other groups
        w[r] = w[300] + 0.002 * torch.randn(576, generator=gen)
    codes, scales = quantize_blocks_int8(w)
    x = torch.cat([torch.randn(40, 576, generator=gen) * torch.logspace(-3, 2, 40).unsqueeze(1),
                   w[300] * 40 + torch.randn(26, 576, generator=gen)])
    for nan in (False, True):
        if nan:
            scales[37, 3] = float("nan")
        packed, pscales = kc.q8_x16_pack(codes, scales)
        bounds = kc.q8_x16_row_bounds(packed, pscales)
        previous = kc.use_tiles("argmax", False)
        try:
            for rows in (x, x[:17], x[:8]):
                kc.use_tiles("argmax", False)
                ids, exact = kc.q8_x16_argmax(rows, packed, pscales, bounds, "avx512_vnni")
                kc.use_tiles("argmax", True)
                tiled = kc.q8_x16_argmax(rows, packed, pscales, bounds, "avx512_vnni")
                assert torch.equal(tiled[0], ids) and tiled[1] == exact
                full = kc.q8_x16_matmul(rows, packed, pscales, "avx512_vnni")
                assert ids.tolist() == ops.argmax_rows(full)
                assert exact < rows.shape[0] * n // 16 or nan
        finally:
            kc.use_tiles("argmax", previous)
