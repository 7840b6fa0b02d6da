"""The native decode attention's cascade (attention.c, `shared_min`): rows whose key rows
begin with the same slots read those keys once together. Held to a float64 attention over the
same pool, and to the rows-alone path: rows outside every shared group keep its bits. On AMX
CPUs a bf16 pool's cascade runs on tiles (amx_attn.c), held to float64 by its own bound."""

from __future__ import annotations

import pytest
import torch

from sglang_like_kernels import cpu as kc
from sglang_like_kernels import kv_quant
from sglang_like_kernels.cpu import amx, ops

pytestmark = pytest.mark.skipif(not kc.available(), reason="needs a C compiler and AVX2")


@pytest.fixture(autouse=True)
def vector_cascade():
    """The vector unit's cascade for every test here but those that ask for the tiles: whether
    the AMX library (which lends the tiles) was loaded by an earlier test must not matter."""
    previous = kc.use_tiles("cascade", False)
    yield
    kc.use_tiles("cascade", previous)

HQ, HKV, D = 9, 3, 64
SHARED = 64  # native_decode.SHARED_PREFIX_MIN


def _case(pool_dtype, gen):
    """A pool and a key table of 10 rows, in this order: four rows on a 700-key prefix
    (rows 0, 2, 5, 9: own keys 1 to 40), two on another 90-key prefix (1, 6), one on the
    first prefix's first 20 keys only (3: under SHARED), two alone (4, 7) and row 8 on the
    first prefix's 300 keys (it joins the group, which then shares 300; cut where members
    agree a block of 64 keys or more further, row 8 keeps its 300 in a group of its own and
    the four rows share their 700)."""
    slots = 3000
    x_k = torch.randn(slots, HKV, D, generator=gen)
    x_v = torch.randn(slots, HKV, D, generator=gen)
    if kv_quant.is_quantized(pool_dtype):
        k, ks = kv_quant.quantize(x_k, pool_dtype)
        v, vs = kv_quant.quantize(x_v, pool_dtype)
    else:
        k, v, ks, vs = x_k.to(pool_dtype), x_v.to(pool_dtype), None, None
    perm = (torch.randperm(slots - 1, generator=gen) + 1).int()
    first, second = perm[:700], perm[700:790]
    fresh = iter(perm[800:].tolist())
    layout = {0: (first, 700, 5), 2: (first, 700, 40), 5: (first, 700, 1), 9: (first, 700, 17),
              1: (second, 90, 3), 6: (second, 90, 30), 3: (first, 20, 50), 4: (None, 0, 120),
              7: (None, 0, 64), 8: (first, 300, 9)}
    table = torch.zeros(11, 760, dtype=torch.int32)
    lens = []
    for r in range(10):
        prefix, n, own = layout[r]
        if n:
            table[r + 1, :n] = prefix[:n]
        table[r + 1, n:n + own] = torch.tensor([next(fresh) for _ in range(own)],
                                               dtype=torch.int32)
        lens.append(n + own)
    return k, v, ks, vs, table, torch.arange(1, 11), torch.tensor(lens)


def _attend(qkv, k, v, ks, vs, table, rows, lens, **kw):
    """No RoPE; each row's new k/v goes to its last slot."""
    out_slots = table[rows, lens - 1].long()
    return ops.decode_attention_rope(qkv, HQ, HKV, D, None, None, lens - 1, k, v, out_slots,
                                     table, rows, lens, D**-0.5, torch.float32, k_scale=ks,
                                     v_scale=vs, **kw)


def _float64(qkv, k, v, ks, vs, table, rows, lens, softcap=None):
    """Each row's attention in float64 over the pool as stored (its rows read as floats)."""
    kf = kv_quant.dequantize(k, ks) if ks is not None else k.float()
    vf = kv_quant.dequantize(v, vs) if vs is not None else v.float()
    out = []
    for b in range(rows.shape[0]):
        s = table[rows[b], : lens[b]].long()
        q = qkv[b, : HQ * D].double().view(HKV, HQ // HKV, D)
        kk, vv = kf[s].double().transpose(0, 1), vf[s].double().transpose(0, 1)  # [Hkv, n, D]
        scores = torch.einsum("hgd,hnd->hgn", q, kk) * D**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out.append(torch.einsum("hgn,hnd->hgd", scores.softmax(-1), vv).reshape(-1))
    return torch.stack(out)


GROUPED = [0, 2, 5, 9, 8, 1, 6]
ALONE = [3, 4, 7]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                        torch.float8_e4m3fn])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_rows_on_a_shared_prefix_read_it_together(pool_dtype, softcap):
    gen = torch.Generator().manual_seed(3)
    k, v, ks, vs, table, rows, lens = _case(pool_dtype, gen)
    qkv = torch.randn(10, (HQ + 2 * HKV) * D, generator=gen)
    alone = _attend(qkv, k, v, ks, vs, table, rows, lens, softcap=softcap)
    shared = _attend(qkv, k, v, ks, vs, table, rows, lens, softcap=softcap, shared_min=SHARED)
    want = _float64(qkv, k, v, ks, vs, table, rows, lens, softcap).float()
    # float32 sums of up to 745 keys in another order; a quantized pool's rows are read back
    # as code * scale, the same values in both
    scale = want.abs().max().item()
    # an int8 pool's rows read their own keys (after the shared ones) with the query rounded
    # to int16 (about 5 digits): its bound is that rounding's
    atol = (1e-5 if pool_dtype == torch.int8 else 2e-6) * scale
    torch.testing.assert_close(shared[GROUPED], want[GROUPED], rtol=1e-5, atol=atol)
    # the rows no group took run the rows-alone code: the same bits
    for r in ALONE:
        assert torch.equal(shared[r], alone[r]), r
    # the grouped rows took the other sums (the cascade ran): not one of them the same bits
    assert all(not torch.equal(shared[r], alone[r]) for r in GROUPED)
    if pool_dtype != torch.int8:  # int8's rows alone round the query to int16 first
        torch.testing.assert_close(alone, want, rtol=1e-5, atol=2e-6 * scale)


def test_the_groups_of_decode_rows():
    """Decode rows (one a request) share all their common prefix, cut only where some agree a
    block or more further: the case above, and 4 requests on one 200-key prefix (one group of
    200, not the block boundary 192)."""
    gen = torch.Generator().manual_seed(3)
    _, _, _, _, table, rows, lens = _case(torch.bfloat16, gen)
    assert sorted(ops.shared_groups(table, rows, lens, SHARED)) == [
        (90, [1, 6]), (300, [8]), (700, [0, 2, 5, 9])]
    table = torch.zeros(5, 300, dtype=torch.int32)
    table[1:, :200] = torch.arange(1, 201, dtype=torch.int32)
    for r, own in enumerate((10, 50, 1, 33)):
        table[r + 1, 200:200 + own] = torch.arange(own, dtype=torch.int32) + 1000 * (r + 1)
    lens = torch.tensor([210, 250, 201, 233])
    assert ops.shared_groups(table, torch.arange(1, 5), lens, SHARED) == [(200, [0, 1, 2, 3])]


def _causal_run(gen, pool_dtype, prefix, new):
    """One request's extend of `new` tokens after `prefix` cached ones (a cold prompt at
    prefix 0): row i reads the first prefix + i + 1 slots of table row 1."""
    slots = prefix + new + 1
    x_k = torch.randn(slots, HKV, D, generator=gen)
    x_v = torch.randn(slots, HKV, D, generator=gen)
    if kv_quant.is_quantized(pool_dtype):
        (k, ks), (v, vs) = kv_quant.quantize(x_k, pool_dtype), kv_quant.quantize(x_v, pool_dtype)
    else:
        k, v, ks, vs = x_k.to(pool_dtype), x_v.to(pool_dtype), None, None
    table = torch.zeros(2, prefix + new + 8, dtype=torch.int32)
    table[1, : prefix + new] = (torch.randperm(slots - 1, generator=gen) + 1).int()
    rows = torch.ones(new, dtype=torch.int64)
    lens = torch.arange(prefix + 1, prefix + new + 1)
    qkv = torch.randn(new, (HQ + 2 * HKV) * D, generator=gen)
    return qkv, k, v, ks, vs, table, rows, lens


def test_a_prompt_s_own_rows_read_the_keys_before_each_block_together():
    """A causal run's rows (a cold prompt of 300 tokens; 200 more after 100 cached) share
    the keys before their block of 64 positions, so a row reads at most a block of keys
    alone; the rows before the first block (too few keys to share) read alone."""
    gen = torch.Generator().manual_seed(9)
    _, _, _, _, _, table, rows, lens = _causal_run(gen, torch.bfloat16, 0, 300)
    groups = ops.shared_groups(table, rows, lens, SHARED)
    assert [(n, r[0] + 1, r[-1] + 1, len(r)) for n, r in groups] == [
        (64, 65, 128, 64), (128, 129, 192, 64), (192, 193, 256, 64), (256, 257, 300, 44)]
    _, _, _, _, _, table, rows, lens = _causal_run(gen, torch.bfloat16, 100, 200)
    groups = ops.shared_groups(table, rows, lens, SHARED)
    # the same blocks as cold: the boundaries are positions, whatever was cached
    assert [(n, r[0] + 101, r[-1] + 101) for n, r in groups] == [
        (64, 101, 128), (128, 129, 192), (192, 193, 256), (256, 257, 300)]


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("prefix", [0, 100])
def test_a_causal_run_through_the_cascade(pool_dtype, prefix):
    """Its rows against float64, on the vector cascade and (bf16, AMX) on the tiles; rows in
    no group keep the rows-alone bits. An int8 pool's rows read their own keys with the
    query rounded to int16, as in the case above, but up to 64 keys (there: 40): 2e-5 of the
    scale (1.4e-5 seen)."""
    gen = torch.Generator().manual_seed(10 + prefix)
    qkv, k, v, ks, vs, table, rows, lens = _causal_run(gen, pool_dtype, prefix, 300)
    alone = _attend(qkv, k, v, ks, vs, table, rows, lens)
    want = _float64(qkv, k, v, ks, vs, table, rows, lens).float()
    ungrouped = [r for r in range(300) if lens[r] <= SHARED]
    runs = [(False, {"rtol": 1e-5, "atol": (2e-5 if pool_dtype == torch.int8 else 2e-6)
                     * want.abs().max().item()})]
    if amx.available() and pool_dtype == torch.bfloat16:
        runs.append((True, _tiles_bound(want)))
    for tiles, bound in runs:
        kc.use_tiles("cascade", tiles)
        shared = _attend(qkv, k, v, ks, vs, table, rows, lens, shared_min=SHARED)
        torch.testing.assert_close(shared, want, **bound)
        for r in ungrouped:
            assert torch.equal(shared[r], alone[r]), r
        assert not torch.equal(shared[-1], alone[-1])  # the last row's keys came by group


def test_a_prompt_part_cached_sums_its_rows_as_cold():
    """Rows 100 to 299 of a prompt computed cold (all 300 rows) and after the first 100 came
    from the cache: the same keys shared by each row, so the same bits (vector cascade, and
    the tiles on AMX); what a radix hit changes in a prompt's attention is nothing."""
    gen = torch.Generator().manual_seed(11)
    qkv, k, v, ks, vs, table, rows, lens = _causal_run(gen, torch.bfloat16, 0, 300)
    for tiles in (False, True) if amx.available() else (False,):
        kc.use_tiles("cascade", tiles)
        cold = _attend(qkv, k, v, ks, vs, table, rows, lens, shared_min=SHARED)
        hit = _attend(qkv[100:], k, v, ks, vs, table, rows[100:], lens[100:],
                      shared_min=SHARED)
        assert torch.equal(hit, cold[100:]), tiles


def test_a_window_or_a_short_prefix_keeps_every_row_alone():
    gen = torch.Generator().manual_seed(4)
    k, v, ks, vs, table, rows, lens = _case(torch.bfloat16, gen)
    qkv = torch.randn(10, (HQ + 2 * HKV) * D, generator=gen)
    for kw in ({"window": 500}, {}):
        alone = _attend(qkv, k, v, ks, vs, table, rows, lens, **kw)
        # a window: rows start at different keys, no cascade; a bar above every shared run
        shared_min = SHARED if kw else 701
        shared = _attend(qkv, k, v, ks, vs, table, rows, lens, shared_min=shared_min, **kw)
        assert torch.equal(shared, alone)


def _many_rows(gen, d, dtype):
    """33 rows (4 query heads, 2 KV heads of size d) on one 300-key prefix, one key each of
    their own: (qkv, the other arguments of ops.decode_attention_rope)."""
    k = torch.randn(2000, 2, d, generator=gen).to(dtype)
    v = torch.randn(2000, 2, d, generator=gen).to(dtype)
    perm = (torch.randperm(1999, generator=gen) + 1).int()
    n = 33
    table = torch.zeros(n + 1, 400, dtype=torch.int32)
    table[1:, :300] = perm[:300]
    table[1:, 300] = perm[300:300 + n]
    rows, lens = torch.arange(1, n + 1), torch.full((n,), 301)
    qkv = torch.randn(n, 8 * d, generator=gen)
    out_slots = table[rows, 300].long()
    return qkv, (4, 2, d, None, None, lens - 1, k, v, out_slots, table, rows, lens, d**-0.5,
                 torch.float32)


def test_a_group_of_many_rows_and_head_sizes():
    """33 rows on one prefix (six query blocks and a rest of three heads) at D = 128, and the
    same rows at D = 72 (not a multiple of 16: every row alone)."""
    gen = torch.Generator().manual_seed(5)
    for d, cascades in ((128, True), (72, False)):
        qkv, args = _many_rows(gen, d, torch.bfloat16)
        alone = ops.decode_attention_rope(qkv, *args)
        shared = ops.decode_attention_rope(qkv, *args, shared_min=SHARED)
        assert torch.equal(alone, shared) != cascades
        torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(len(kc.supported_isas()) < 2, reason="needs both kernel builds")
def test_the_cascade_is_the_same_bits_in_both_builds():
    """Each shared score and output is one FMA chain in order, at 8 or 16 lanes alike."""
    gen = torch.Generator().manual_seed(6)
    k, v, ks, vs, table, rows, lens = _case(torch.bfloat16, gen)
    qkv = torch.randn(10, (HQ + 2 * HKV) * D, generator=gen)
    got = [_attend(qkv, k, v, ks, vs, table, rows, lens, shared_min=SHARED, variant=variant)
           for variant in kc.supported_isas()]
    assert torch.equal(got[0], got[1])


needs_amx = pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX tiles")


def _tiles_bound(want):
    """The tiles carry each query (times the softmax scale) and each softmax weight as two
    bf16 parts, 16 significant bits (2^-17 relative) against float32's 24: on these cases
    the output is off float64 by 4e-6 of its scale (the vector cascade: 7e-7); the bound
    is 2e-5 of it."""
    return {"rtol": 1e-5, "atol": 2e-5 * want.abs().max().item()}


@needs_amx
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_tiles_cascade_over_a_bf16_pool(softcap):
    """Groups of 15 and 6 query rows (a partial tile each), shared runs of 700 and 90 keys
    (chunks that end inside a block of 32), loners and a row under the bar."""
    gen = torch.Generator().manual_seed(7)
    k, v, ks, vs, table, rows, lens = _case(torch.bfloat16, gen)
    qkv = torch.randn(10, (HQ + 2 * HKV) * D, generator=gen)
    alone = _attend(qkv, k, v, ks, vs, table, rows, lens, softcap=softcap)
    vector = _attend(qkv, k, v, ks, vs, table, rows, lens, softcap=softcap, shared_min=SHARED)
    kc.use_tiles("cascade", True)
    tiles = _attend(qkv, k, v, ks, vs, table, rows, lens, softcap=softcap, shared_min=SHARED)
    want = _float64(qkv, k, v, ks, vs, table, rows, lens, softcap).float()
    torch.testing.assert_close(tiles[GROUPED], want[GROUPED], **_tiles_bound(want))
    for r in ALONE:
        assert torch.equal(tiles[r], alone[r]), r
    # the tiles ran: none of the grouped rows has the vector cascade's bits
    assert all(not torch.equal(tiles[r], vector[r]) for r in GROUPED)


@needs_amx
def test_the_tiles_cascade_at_other_head_sizes_and_pools():
    """33 rows on one prefix: at D = 128 and 96 (66 query rows: four full tiles and one of 2;
    96 = 64 + a last pass of 32 dims) the tiles run; at D = 80 (not a multiple of 32) and on a
    float32 pool the vector cascade does, with its bits."""
    gen = torch.Generator().manual_seed(8)
    for d, dtype, on_tiles in ((128, torch.bfloat16, True), (96, torch.bfloat16, True),
                               (80, torch.bfloat16, False), (64, torch.float32, False)):
        qkv, args = _many_rows(gen, d, dtype)
        k, v, table, rows = args[6], args[7], args[9], args[10]
        kc.use_tiles("cascade", False)
        vector = ops.decode_attention_rope(qkv, *args, shared_min=SHARED)
        kc.use_tiles("cascade", True)
        tiles = ops.decode_attention_rope(qkv, *args, shared_min=SHARED)
        assert torch.equal(tiles, vector) != on_tiles, d
        kf, vf = k.double(), v.double()
        want = []
        for b in range(rows.shape[0]):
            s = table[rows[b], :301].long()
            q = qkv[b, : 4 * d].double().view(2, 2, d)
            scores = torch.einsum("hgd,hnd->hgn", q, kf[s].transpose(0, 1)) * d**-0.5
            want.append(torch.einsum("hgn,hnd->hgd", scores.softmax(-1),
                                     vf[s].transpose(0, 1)).reshape(-1))
        want = torch.stack(want).float()
        torch.testing.assert_close(tiles, want, **_tiles_bound(want))
