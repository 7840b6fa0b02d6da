"""What the model families add to the native CPU decode kernels (attention.c, ops.c,
decode_step.c): sliding windows, soft-capped scores, q/k norms, no RoPE or a second RoPE
table, GeGLU, residual scales, the "sandwich" and "post" norm layouts.

Each op against torch math (within float rounding), and the one-call step against the per-op
calls bit for bit, on every build this CPU runs (a machine with AVX-512 VNNI runs the AVX2
build too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sglang_like_kernels.cpu as kc
from sglang_like.layers.quantization import q4_1_blocks
from sglang_like.layers.rotary import RotaryEmbedding
from sglang_like_kernels import reference
from sglang_like_kernels.cpu import ops

pytestmark = pytest.mark.skipif(not kc.available(), reason="needs a C compiler and AVX2")
VARIANTS = kc.supported_isas()
F32 = torch.float32


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


class _Rows:
    """Requests at random distinct slots of a pool, one row of a slot table each."""

    def __init__(self, lens: list[int], hkv: int, dim: int, pool_dtype: torch.dtype,
                 seed: int, slots: int = 1500) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.k = torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)
        self.v = torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)
        width = max(lens) + 8
        self.table = torch.randint(1, slots, (len(lens) + 1, width), generator=gen,
                                   dtype=torch.int32)
        self.rows = torch.arange(len(lens), 0, -1)
        perm = torch.randperm(slots - 1, generator=gen) + 1
        start = 0
        for r, n in zip(self.rows.tolist(), lens, strict=True):
            self.table[r, :n] = perm[start : start + n].int()
            start += n
        self.seq_lens = torch.tensor(lens)
        self.positions = self.seq_lens - 1
        self.out_slots = torch.stack([self.table[r, n - 1].long()
                                      for r, n in zip(self.rows.tolist(), lens, strict=True)])


def _torch_qk(qkv: torch.Tensor, hq: int, hkv: int, dim: int, qk_norm: str | None,
              q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float,
              rope: RotaryEmbedding | None, positions: torch.Tensor):
    """q, k, v as the torch layer computes them: q/k norm, then RoPE (or none)."""
    t = qkv.shape[0]
    q = qkv[:, : hq * dim].float()
    k = qkv[:, hq * dim : (hq + hkv) * dim].float()
    v = qkv[:, (hq + hkv) * dim :].float().view(t, hkv, dim)
    if qk_norm == "full":
        q, k = _rmsnorm(q, q_w, eps), _rmsnorm(k, k_w, eps)
    q, k = q.view(t, hq, dim), k.view(t, hkv, dim)
    if qk_norm == "head":
        q, k = _rmsnorm(q, q_w, eps), _rmsnorm(k, k_w, eps)
    if rope is not None:
        qk = rope.tables(positions).rotate(torch.cat([q, k], dim=1))
        q, k = qk[:, :hq], qk[:, hq:]
    return q.contiguous(), k.contiguous(), v


# window, softcap, rope ("global", "local" or "none"), qk_norm
ATTN_CASES = [
    (None, None, "global", None),
    (1, None, "global", None),
    (5, 2.5, "global", None),
    (37, None, "none", None),
    (260, 4.0, "local", "head"),  # the 600-key row: chunks from key 340 on
    (600, None, "global", "full"),  # exactly the longest context
    (4096, 1.5, "none", "head"),  # longer than every context
    (None, 30.0, "global", "full"),
]


@pytest.mark.parametrize("window,softcap,rope_kind,qk_norm", ATTN_CASES)
@pytest.mark.parametrize("pool_dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
def test_decode_attention_features_match_torch(window, softcap, rope_kind, qk_norm, pool_dtype,
                                               heads):
    """decode_attention_rope with a window, a soft-cap, q/k norms and any RoPE table against
    the torch layer's steps: norm, rotate, store, attend (the torch reference, checked
    against a dense attention in test_window_softcap.py)."""
    (hq, hkv), dim, eps = heads, 64, 1e-6
    lens = [1, 37, 300, 600]
    r = _Rows(lens, hkv, dim, pool_dtype, seed=hq + (window or 0))
    gen = r.gen
    theta = {"global": 10000.0, "local": 500.0}.get(rope_kind)
    rope = RotaryEmbedding(dim, 1024, theta, None, "cpu") if theta else None
    sizes = {"head": (dim, dim), "full": (hq * dim, hkv * dim)}.get(qk_norm, (0, 0))
    q_w = torch.rand(sizes[0], generator=gen) + 0.5 if qk_norm else None
    k_w = torch.rand(sizes[1], generator=gen) + 0.5 if qk_norm else None
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * dim, generator=gen) * 2
    k_ref, v_ref = r.k.clone(), r.v.clone()
    got = ops.decode_attention_rope(
        qkv, hq, hkv, dim, rope.cos_table if rope else None, rope.sin_table if rope else None,
        r.positions, r.k, r.v, r.out_slots, r.table, r.rows, r.seq_lens, dim**-0.5, F32,
        window=window, softcap=softcap, qk_norm=qk_norm, q_norm=q_w, k_norm=k_w, qk_eps=eps)
    q, k, v = _torch_qk(qkv, hq, hkv, dim, qk_norm, q_w, k_w, eps, rope, r.positions)
    reference.store_kv(k_ref, v_ref, r.out_slots, k, v)
    torch.testing.assert_close(r.k.float(), k_ref.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(r.v, v_ref)
    want = reference.decode_attention(q, r.k, r.v, r.table, r.rows, r.seq_lens, dim**-0.5,
                                      window=window, softcap=softcap)
    torch.testing.assert_close(got.view(len(lens), hq, dim), want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("window,softcap", [(3, None), (40, 2.0), (1300, 5.0)])
def test_windowed_rows_sharing_a_prefix_are_each_rows_own_bits(window, softcap):
    """A verify's rows (a shared prefix, then each row's tree path) under a window: each
    row's output is the bits of that row alone, and its last `window` keys' attention."""
    hq, hkv, dim, n_rows, prefix = 8, 2, 64, 6, 1500
    gen = torch.Generator().manual_seed(window)
    k_pool = torch.randn(1600, hkv, dim, generator=gen).bfloat16()
    v_pool = torch.randn(1600, hkv, dim, generator=gen).bfloat16()
    perm = (torch.randperm(1599, generator=gen) + 1).int()
    shared, nodes = perm[:prefix], perm[prefix : prefix + n_rows]
    paths = [[j for j in range(i + 1) if j == 0 or j % 2 == 1 or j == i] for i in range(n_rows)]
    table = torch.zeros(n_rows + 1, prefix + n_rows, dtype=torch.int32)
    for i, path in enumerate(paths):
        table[i + 1, :prefix] = shared
        table[i + 1, prefix : prefix + len(path)] = nodes[path]
    rows = torch.arange(1, n_rows + 1)
    seq_lens = torch.tensor([prefix + len(p) for p in paths])
    positions = seq_lens - 1
    qkv = torch.randn(n_rows, (hq + 2 * hkv) * dim, generator=gen)
    kw = dict(window=window, softcap=softcap)
    together = ops.decode_attention_rope(qkv, hq, hkv, dim, None, None, positions, k_pool,
                                         v_pool, nodes.long(), table, rows, seq_lens,
                                         dim**-0.5, F32, **kw)
    for i in range(n_rows):
        one = slice(i, i + 1)
        alone = ops.decode_attention_rope(qkv[one], hq, hkv, dim, None, None, positions[one],
                                          k_pool, v_pool, nodes.long()[one], table, rows[one],
                                          seq_lens[one], dim**-0.5, F32, **kw)
        assert torch.equal(alone[0], together[i]), f"row {i}"
    q = qkv[:, : hq * dim].reshape(n_rows, hq, dim)
    want = reference.decode_attention(q, k_pool, v_pool, table, rows, seq_lens, dim**-0.5, **kw)
    torch.testing.assert_close(together.view(n_rows, hq, dim), want, rtol=3e-5, atol=3e-5)


def test_decode_attention_refuses_bad_settings():
    r = _Rows([4], 1, 16, F32, seed=1)
    qkv = torch.randn(1, 3 * 16)
    args = (qkv, 1, 1, 16, None, None, r.positions, r.k, r.v, r.out_slots, r.table, r.rows,
            r.seq_lens, 0.25, F32)
    with pytest.raises(ValueError):
        ops.decode_attention_rope(*args, window=0)
    with pytest.raises(ValueError):
        ops.decode_attention_rope(*args, softcap=-1.0)
    with pytest.raises(TypeError, match="q_norm"):
        ops.decode_attention_rope(*args, qk_norm="head", q_norm=torch.ones(8),
                                  k_norm=torch.ones(16))


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("inter", [100, 96, 3])  # tails of 4 and of 3, none
def test_gelu_tanh_mul_matches_torch(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(4, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([0.0, 30.0, -30.0]).to(dtype)  # zero and saturated tanh
    got = ops.act_mul(gate_up, "gelu_tanh", F32)
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(got, F.gelu(g, approximate="tanh") * u, rtol=1e-5, atol=2e-6)
    assert ops.act_mul(gate_up, "gelu_tanh", torch.bfloat16).dtype == torch.bfloat16
    # silu through act_mul is silu_mul, bit for bit
    assert torch.equal(ops.act_mul(gate_up, "silu", F32), ops.silu_mul(gate_up, F32))


@pytest.mark.parametrize("out_dtype", [F32, torch.bfloat16])
def test_residual_norm_in_every_layout(out_dtype):
    gen = torch.Generator().manual_seed(6)
    hidden, eps = 576, 1e-6
    x, d = torch.randn(5, hidden, generator=gen), torch.randn(5, hidden, generator=gen) * 3
    w, w_sub = (torch.rand(hidden, generator=gen) + 0.5 for _ in range(2))
    tol = 1e-5 if out_dtype == F32 else 8e-3
    # Llama's: add_rmsnorm bit for bit
    x1, h1 = ops.residual_norm(x, d, w, eps, out_dtype)
    x2, h2 = ops.add_rmsnorm(x, d, w, eps, out_dtype)
    assert torch.equal(x1, x2) and torch.equal(h1, h2)
    # sandwich with a residual scale: x + 0.25 * norm(d), then the next norm
    x_new, h = ops.residual_norm(x, d, w, eps, out_dtype, sub_weight=w_sub, sub_eps=eps,
                                 scale=0.25)
    want_x = x + 0.25 * _rmsnorm(d, w_sub, eps)
    torch.testing.assert_close(x_new, want_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.float(), _rmsnorm(x_new, w, eps), rtol=tol, atol=tol)
    # post: the next sub-layer reads the residual itself
    x_new, h = ops.residual_norm(x, d.bfloat16(), None, eps, out_dtype, sub_weight=w_sub,
                                 sub_eps=eps)
    torch.testing.assert_close(x_new, x + _rmsnorm(d.bfloat16().float(), w_sub, eps),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(h, x_new.to(out_dtype))
    # a residual scale alone
    x_new, _ = ops.residual_norm(x, d, w, eps, F32, scale=0.5)
    assert torch.equal(x_new, x + d * 0.5)


# The fused step against the per-op calls. Each case: per layer, (layout, activation, rope,
# qk_norm, window, softcap, residual_scale); layers differ where a family's do (Gemma 2's
# sliding / full alternation, Gemma 3's local / global RoPE, SmolLM3's NoPE layers).
STEP_CASES = {
    "window_softcap": [("pre", "silu", "global", None, 5, 3.0, 1.0),
                       ("pre", "silu", "global", None, None, 3.0, 1.0)],
    "gelu_tanh": [("pre", "gelu_tanh", "global", None, None, None, 1.0)] * 2,
    "rope_none_local": [("pre", "silu", "local", None, 40, None, 1.0),
                        ("pre", "silu", "none", None, None, None, 1.0),
                        ("pre", "silu", "global", None, None, None, 1.0)],
    "residual_scale": [("pre", "silu", "global", None, None, None, 0.22)] * 2,
    "qk_head": [("pre", "silu", "global", "head", None, None, 1.0)] * 2,
    "sandwich": [("sandwich", "gelu_tanh", "local", "head", 7, 2.0, 1.0),
                 ("sandwich", "gelu_tanh", "global", "head", None, 2.0, 1.0)],
    "post": [("post", "silu", "global", None, None, None, 1.0)] * 2,
    "qk_full": [("post", "silu", "global", "full", None, None, 1.0)] * 2,
    "three_windows": [("pre", "silu", "global", None, w, None, 1.0) for w in (3, None, 300, 3)],
}


class _StepLayer:
    """One layer's weights (x16 int4), norms and settings, as the per-op calls and the
    fused table read them."""

    def __init__(self, spec, hidden, hq, hkv, dim, inter, gen):
        (self.layout, self.act, self.rope, self.qk_norm, self.window, self.softcap,
         self.scale) = spec

        def packed(n, k):
            w = torch.randn(n, k, generator=gen) * 0.1
            return kc.q4_x16_pack(q4_1_blocks(w), n, k)

        def norm(n):
            return torch.rand(n, generator=gen) + 0.5

        self.weights = [packed((hq + 2 * hkv) * dim, hidden), packed(hidden, hq * dim),
                        packed(2 * inter, hidden), packed(hidden, inter)]
        pre = self.layout != "post"
        self.norm_in = norm(hidden) if pre else None
        self.norm_mlp = norm(hidden) if pre else None
        self.attn_out = norm(hidden) if self.layout != "pre" else None
        self.mlp_out = norm(hidden) if self.layout != "pre" else None
        size = {"head": (dim, dim), "full": (hq * dim, hkv * dim)}.get(self.qk_norm)
        self.q_norm = norm(size[0]) if size else None
        self.k_norm = norm(size[1]) if size else None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pool_dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_decode_step_features_are_the_per_op_calls_bit_for_bit(variant, pool_dtype, t, case):
    specs = STEP_CASES[case]
    hidden, hq, hkv, dim, inter, eps, sm_scale = 64, 4, 2, 16, 96, 1e-6, 0.3
    gen = torch.Generator().manual_seed(len(case) * 31 + t)
    layers = [_StepLayer(s, hidden, hq, hkv, dim, inter, gen) for s in specs]
    n_layers = len(layers)
    slots = 1700
    pools = [(torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype),
              torch.randn(slots, hkv, dim, generator=gen).to(pool_dtype)) for _ in layers]
    ropes = {"global": RotaryEmbedding(dim, 1024, 10000.0, None, "cpu"),
             "local": RotaryEmbedding(dim, 1024, 10.0, None, "cpu")}
    lens = [(1, 37, 300, 600)[i % 4] + i for i in range(t)]
    r = _Rows(lens, hkv, dim, pool_dtype, seed=t, slots=slots)
    x0 = torch.randn(t, hidden, generator=gen) * 2

    # the per-op calls (native_decode.NativeDecodePlan.run, one op at a time)
    ref_pools = [(k.clone(), v.clone()) for k, v in pools]
    x = x0.clone()
    first = layers[0]
    h = ops.rmsnorm(x, first.norm_in, eps, F32) if first.norm_in is not None else x.clone()
    aux_want = None
    for i, ly in enumerate(layers):
        if i == 1:
            aux_want = x.clone()
        w_qkv, w_o, w_gu, w_down = ly.weights
        tables = (None, None) if ly.rope == "none" else (ropes[ly.rope].cos_table,
                                                         ropes[ly.rope].sin_table)
        a = ops.decode_attention_rope(
            kc.q4_x16_matmul(h, w_qkv, (hq + 2 * hkv) * dim, variant), hq, hkv, dim, *tables,
            r.positions, *ref_pools[i], r.out_slots, r.table, r.rows, r.seq_lens, sm_scale, F32,
            window=ly.window, softcap=ly.softcap, qk_norm=ly.qk_norm, q_norm=ly.q_norm,
            k_norm=ly.k_norm, qk_eps=eps)
        x, h = ops.residual_norm(x, kc.q4_x16_matmul(a, w_o, hidden, variant), ly.norm_mlp, eps,
                                 F32, ly.attn_out, eps, ly.scale)
        act = ops.act_mul(kc.q4_x16_matmul(h, w_gu, 2 * inter, variant), ly.act, F32)
        down = kc.q4_x16_matmul(act, w_down, hidden, variant)
        nxt = layers[i + 1].norm_in if i + 1 < n_layers else None
        x, h = ops.residual_norm(x, down, nxt, eps, F32, ly.mlp_out, eps, ly.scale)

    def addr(w):
        return 0 if w is None else w.data_ptr()

    ptrs = torch.tensor([[*(w.data_ptr() for w in ly.weights), addr(ly.norm_in),
                          addr(ly.norm_mlp), pools[i][0].data_ptr(), pools[i][1].data_ptr(),
                          addr(ly.attn_out), addr(ly.mlp_out), addr(ly.q_norm), addr(ly.k_norm),
                          0, 0]  # no biases
                         for i, ly in enumerate(layers)], dtype=torch.int64)
    settings = [ops.layer_settings(ly.window, ly.rope, ly.qk_norm, ly.act, sm_scale, ly.softcap,
                                   ly.scale) for ly in layers]
    cfg = torch.tensor([c for c, _ in settings], dtype=torch.int64)
    fcfg = torch.tensor([f for _, f in settings], dtype=F32)
    local = (ropes["local"].cos_table, ropes["local"].sin_table)
    aux = torch.full((n_layers,), -1, dtype=torch.int64)
    aux[1] = 0
    got, features = x0.clone(), torch.empty(t, hidden)
    ops.decode_step_x16(n_layers, got, ptrs, eps, pool_dtype, ropes["global"].cos_table,
                        ropes["global"].sin_table, r.positions, r.out_slots, r.table, r.rows,
                        r.seq_lens, hq, hkv, dim, inter, sm_scale, aux, features, variant,
                        cfg=cfg, fcfg=fcfg, local_tables=local)
    assert torch.equal(got, x)
    assert torch.equal(features, aux_want)
    for (k, v), (k_ref, v_ref) in zip(pools, ref_pools, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert got.isfinite().all()


def test_decode_step_refuses_settings_it_cannot_run():
    """A local-RoPE layer without the local tables, or five window sizes, is a ValueError
    (not a wrong answer)."""
    gen = torch.Generator().manual_seed(0)
    hidden, hq, hkv, dim, inter = 64, 4, 2, 16, 96
    specs = [("pre", "silu", "local", None, None, None, 1.0)]
    ly = _StepLayer(specs[0], hidden, hq, hkv, dim, inter, gen)
    k, v = torch.zeros(50, hkv, dim), torch.zeros(50, hkv, dim)
    ptrs = torch.tensor([[*(w.data_ptr() for w in ly.weights), ly.norm_in.data_ptr(),
                          ly.norm_mlp.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, 0, 0, 0, 0]])
    rope = RotaryEmbedding(dim, 64, 10000.0, None, "cpu")
    r = _Rows([3], hkv, dim, F32, seed=0, slots=50)
    cfg = torch.tensor([ops.layer_settings(rope="local")[0]])
    args = (1, torch.randn(1, hidden), ptrs, 1e-6, F32, rope.cos_table, rope.sin_table,
            r.positions, r.out_slots, r.table, r.rows, r.seq_lens, hq, hkv, dim, inter, 0.25,
            torch.tensor([-1]), None)
    with pytest.raises(ValueError, match="local_tables"):
        ops.decode_step_x16(*args, cfg=cfg)
    five = torch.tensor([ops.layer_settings(window=w)[0] for w in (1, 2, 3, 4, 5)])
    five_ptrs = ptrs.expand(5, -1).contiguous()
    with pytest.raises(ValueError, match="window sizes"):
        ops.decode_step_x16(5, torch.randn(1, hidden), five_ptrs, *args[3:-2],
                            torch.full((5,), -1), None, cfg=five)
