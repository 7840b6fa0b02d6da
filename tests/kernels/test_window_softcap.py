"""Sliding-window attention and soft-capped scores in every attention backend, each against an
explicit dense attention computed here from positions (transformers' convention: a query at
position p sees keys p - window < j <= p; scores s -> cap * tanh(s / cap) before the mask).

The torch references run in this process. test_triton_kernels.py runs this file again in a
subprocess with TRITON_INTERPRET=1, where the Triton launchers are checked too (the flag must
be set before triton is imported, so they cannot run here).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

import sglang_like_kernels
from sglang_like.layers.attention import Attention, attend
from sglang_like_kernels import reference

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["reference"] + (["triton"] if INTERPRETING else [])


def _module(backend: str):
    if backend == "reference":
        return reference
    from sglang_like_kernels import triton_ops

    return triton_ops


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, seen: torch.Tensor, sm_scale: float, window: int | None,
           softcap: float | None) -> torch.Tensor:
    """q [M, Hq, D] at positions q_pos [M] over keys/values [L, Hkv, D] at k_pos [L], seen
    [M, L] the keys each query may see before the window; float64 [M, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * sm_scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = seen & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), v)


class _Pool:
    """Random pools; request b's keys at distinct random slots in row rows[b] of the table,
    other table cells holding real slot ids too (a read past a length would show)."""

    def __init__(self, lens: list[int], num_kv_heads: int, head_dim: int, seed: int,
                 dtype: torch.dtype = torch.float32, max_context: int = 320) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        num_slots = sum(lens) + 40
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=self.gen).to(dtype)
        self.v = torch.randn(shape, generator=self.gen).to(dtype)
        self.table = torch.randint(1, num_slots, (len(lens) + 2, max_context),
                                   generator=self.gen).to(torch.int32)
        perm = torch.randperm(num_slots - 1, generator=self.gen) + 1
        self.rows = torch.randperm(len(lens) + 2, generator=self.gen)[: len(lens)]
        start = 0
        for row, n in zip(self.rows.tolist(), lens, strict=True):
            self.table[row, :n] = perm[start : start + n].int()
            start += n

    def keys(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.table[self.rows[b], :n].long()
        return self.k[slots], self.v[slots]

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen)


def _check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if INTERPRETING:
        tol = max(tol, 1e-4)  # the Triton soft-cap's tanh is built from exp
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


# (window, softcap): smaller than, equal to and larger than the contexts; with and without cap
SETTINGS = [(1, None), (4, None), (None, 1.5), (16, 2.0), (40, None), (40, 3.0), (1000, 2.0)]
HEADS = [(6, 2), (4, 4), (8, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_decode(backend, window, softcap, num_q_heads, num_kv_heads):
    lens, head_dim = [1, 5, 40, 100, 16], 16
    pool = _Pool(lens, num_kv_heads, head_dim, seed=num_q_heads + (window or 0))
    q = pool.randn(len(lens), num_q_heads, head_dim)
    scale = 1 / math.sqrt(head_dim) * 4  # large scores, so the cap bites
    out = _module(backend).decode_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                            torch.tensor(lens), scale, window=window,
                                            softcap=softcap)
    for b, n in enumerate(lens):
        keys, values = pool.keys(b, n)
        want = _dense(q[b : b + 1], keys, values, torch.tensor([n - 1]), torch.arange(n),
                      torch.ones(1, n, dtype=torch.bool), scale, window, softcap)
        _check(out[b : b + 1], want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,softcap", [(7, None), (33, 2.0), (None, 2.0)])
def test_decode_sharing_a_prefix(backend, window, softcap):
    """Requests whose rows start with the same 60 slots (a radix hit: the reference's cascade
    case without a window) each see only their own last `window` keys."""
    lens, head_dim = [70, 64, 90, 61], 16
    pool = _Pool(lens, 2, head_dim, seed=11)
    common = pool.table[pool.rows[0], :60].clone()
    for b in range(len(lens)):
        pool.table[pool.rows[b], :60] = common
    q = pool.randn(len(lens), 4, head_dim)
    out = _module(backend).decode_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                            torch.tensor(lens), 0.5, window=window,
                                            softcap=softcap)
    for b, n in enumerate(lens):
        keys, values = pool.keys(b, n)
        want = _dense(q[b : b + 1], keys, values, torch.tensor([n - 1]), torch.arange(n),
                      torch.ones(1, n, dtype=torch.bool), 0.5, window, softcap)
        _check(out[b : b + 1], want)


def _check_extend(out, q, pool, prefix_lens, extend_lens, scale, window, softcap):
    start = 0
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        keys, values = pool.keys(b, p + e)
        want = _dense(q[start : start + e], keys, values, torch.arange(p, p + e),
                      torch.arange(p + e), torch.ones(e, p + e, dtype=torch.bool), scale,
                      window, softcap)
        _check(out[start : start + e], want)
        start += e
    assert start == q.shape[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 2), (4, 1)])
def test_extend_after_a_prefix(backend, window, softcap, num_q_heads, num_kv_heads):
    """New tokens after a cached prefix (a radix hit) and after none, one extend of 130
    tokens (several query blocks in the Triton kernel), one request with nothing new."""
    prefix_lens, extend_lens, head_dim = [0, 7, 30, 12, 5], [5, 9, 3, 130, 0], 16
    pool = _Pool([p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
                 num_kv_heads, head_dim, seed=num_q_heads * 7 + (window or 0))
    q = pool.randn(sum(extend_lens), num_q_heads, head_dim)
    scale = 1.0
    out = _module(backend).extend_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                            torch.tensor(prefix_lens), torch.tensor(extend_lens),
                                            scale, window=window, softcap=softcap)
    _check_extend(out, q, pool, prefix_lens, extend_lens, scale, window, softcap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,softcap", [(5, None), (20, 2.0), (None, 1.0), (200, None)])
def test_chunked_prefill(backend, window, softcap):
    """A 100-token prompt prefilled in chunks of 32: each chunk an extend over the chunks
    before it; together every token sees what the whole-prompt oracle says."""
    total, chunk, head_dim = 100, 32, 16
    pool = _Pool([total], 2, head_dim, seed=5)
    q = pool.randn(total, 6, head_dim)
    parts = []
    for p in range(0, total, chunk):
        e = min(chunk, total - p)
        parts.append(_module(backend).extend_attention(
            q[p : p + e], pool.k, pool.v, pool.table, pool.rows, torch.tensor([p]),
            torch.tensor([e]), 0.7, window=window, softcap=softcap))
    _check_extend(torch.cat(parts), q, pool, [0], [total], 0.7, window, softcap)


def _random_tree(num_draft: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree (node i's parent is a node before it)."""
    mask = torch.zeros(num_draft, num_draft, dtype=torch.bool)
    for i in range(num_draft):
        mask[i, i] = True
        if i:
            mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def _tree_positions(prefix_len: int, mask: torch.Tensor) -> torch.Tensor:
    """A node's position: prefix_len + its depth (its ancestors, itself excluded). For a
    causal mask that is prefix_len + j."""
    return prefix_len + mask.sum(dim=1) - 1


def _check_masked(out, q, pool, prefix_lens, trees, scale, window, softcap, rows=None):
    """Request b's queries are the last rows[b] nodes of trees[b] (all of them by default),
    each seeing its prefix and its ancestors-or-self."""
    start = 0
    for b, (p, tree) in enumerate(zip(prefix_lens, trees, strict=True)):
        m = tree.shape[0]
        n = m if rows is None else rows[b]
        keys, values = pool.keys(b, p + m)
        node_pos = _tree_positions(p, tree)
        k_pos = torch.cat([torch.arange(p), node_pos])
        seen = torch.cat([torch.ones(n, p, dtype=torch.bool), tree[m - n :]], dim=1)
        want = _dense(q[start : start + n], keys, values, node_pos[m - n :], k_pos, seen,
                      scale, window, softcap)
        _check(out[start : start + n], want)
        start += n
    assert start == q.shape[0]


TREE_SETTINGS = [(1, None), (3, None), (8, 2.0), (None, 1.5), (35, None), (100, 2.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,softcap", TREE_SETTINGS)
@pytest.mark.parametrize("num_draft", [1, 6, 12])
def test_tree_verify(backend, window, softcap, num_draft):
    prefix_lens, head_dim = [0, 5, 30], 16
    pool = _Pool([p + num_draft for p in prefix_lens], 2, head_dim, seed=num_draft)
    trees = [_random_tree(num_draft, pool.gen) for _ in prefix_lens]
    q = pool.randn(len(prefix_lens) * num_draft, 6, head_dim)
    out = _module(backend).tree_verify_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                                 torch.tensor(prefix_lens), torch.stack(trees),
                                                 0.8, window=window, softcap=softcap)
    _check_masked(out, q, pool, prefix_lens, trees, 0.8, window, softcap)


@pytest.mark.parametrize("window,softcap", TREE_SETTINGS)
def test_masked_mixes_trees_extends_and_decode_rows(window, softcap):
    """Per-request masks (reference on every device): a tree, a causal extend, a decode row
    (one query seeing every new key), and a draft step (the tree's last 2 nodes only)."""
    head_dim = 16
    pool = _Pool([30 + 7, 12 + 6, 40 + 1, 3 + 5], 2, head_dim, seed=3)
    trees = [_random_tree(7, pool.gen), torch.ones(6, 6, dtype=torch.bool).tril(),
             torch.ones(1, 1, dtype=torch.bool), _random_tree(5, pool.gen)]
    rows = [7, 6, 1, 2]
    masks = [t[t.shape[0] - n :] for t, n in zip(trees, rows, strict=True)]
    prefix_lens = [30, 12, 40, 3]
    q = pool.randn(sum(rows), 4, head_dim)
    out = sglang_like_kernels.masked_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                               torch.tensor(prefix_lens), masks, 0.9,
                                               window=window, softcap=softcap)
    _check_masked(out, q, pool, prefix_lens, trees, 0.9, window, softcap, rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_pool(backend):
    """bf16 pools: the window and cap act the same (looser tolerance for the rounding)."""
    lens, head_dim = [50, 9], 32
    pool = _Pool(lens, 2, head_dim, seed=8, dtype=torch.bfloat16)
    q = pool.randn(len(lens), 4, head_dim).bfloat16()
    out = _module(backend).decode_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                            torch.tensor(lens), 0.4, window=10, softcap=2.0)
    assert out.dtype == torch.bfloat16
    for b, n in enumerate(lens):
        keys, values = pool.keys(b, n)
        want = _dense(q[b : b + 1].float(), keys.float(), values.float(), torch.tensor([n - 1]),
                      torch.arange(n), torch.ones(1, n, dtype=torch.bool), 0.4, 10, 2.0)
        _check(out[b : b + 1], want, torch.bfloat16)


if INTERPRETING:

    @pytest.mark.parametrize("num_splits", [1, 3, 7])
    @pytest.mark.parametrize("window", [1, 9, 60, 500])
    def test_triton_decode_splits_cover_the_window(num_splits, window):
        """Flash-decoding splits the visible keys, not the whole sequence: every split count
        gives the dense result (splits past the window's keys are empty)."""
        from sglang_like_kernels import triton_ops

        lens, head_dim = [1, 13, 120, 250], 16
        pool = _Pool(lens, 2, head_dim, seed=window)
        q = pool.randn(len(lens), 4, head_dim)
        out = triton_ops.decode_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                          torch.tensor(lens), 0.5, num_splits=num_splits,
                                          window=window, softcap=2.5, split_min=1)
        for b, n in enumerate(lens):
            keys, values = pool.keys(b, n)
            want = _dense(q[b : b + 1], keys, values, torch.tensor([n - 1]), torch.arange(n),
                          torch.ones(1, n, dtype=torch.bool), 0.5, window, 2.5)
            _check(out[b : b + 1], want)

    def test_triton_without_window_or_cap_compiles_as_before():
        """With both off, the kernels' switches are off (no runtime branch on the values)."""
        from sglang_like_kernels import triton_ops

        meta = triton_ops.extend_meta(64, torch.float32)
        assert meta["USE_WINDOW"] is False and meta["USE_SOFTCAP"] is False
        meta = triton_ops.decode_meta(8, 2, 64, 4096, torch.float32, window=100, softcap=None)
        assert meta["USE_WINDOW"] is True and meta["NUM_SPLITS"] == 1


def test_windowed_paths_leave_the_plain_paths_alone():
    """No window and no cap: the very same numbers as before (decode's cascade included);
    a window at least the context is the plain result up to rounding."""
    lens, head_dim = [70, 64, 90], 16
    pool = _Pool(lens, 2, head_dim, seed=2)
    common = pool.table[pool.rows[0], :60].clone()
    for b in range(len(lens)):
        pool.table[pool.rows[b], :60] = common
    q = pool.randn(len(lens), 4, head_dim)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(lens), 0.5)
    plain = reference.decode_attention(*args)
    assert torch.equal(plain, reference.decode_attention(*args, window=None, softcap=None))
    torch.testing.assert_close(reference.decode_attention(*args, window=90), plain,
                               rtol=1e-5, atol=1e-6)
    # a window smaller than the context changes the answer
    assert not torch.allclose(reference.decode_attention(*args, window=20), plain, atol=1e-3)


def test_refuses_empty_window_and_non_positive_cap():
    lens = [4]
    pool = _Pool(lens, 1, 16, seed=1)
    q = pool.randn(1, 1, 16)
    for backend in BACKENDS:
        mod = _module(backend)
        with pytest.raises(ValueError):
            mod.decode_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(lens),
                                 0.5, window=0)
        with pytest.raises(ValueError):
            mod.decode_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(lens),
                                 0.5, softcap=0.0)
        with pytest.raises(ValueError):
            mod.extend_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor([3]),
                                 torch.tensor([1]), 0.5, window=-2)


def _fb(**fields) -> SimpleNamespace:
    base = dict(custom_masks=None, positional_masks=None, custom_mask_meta=None, tree_mask=None,
                is_decode=False, max_extend_len=None)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("kind", ["decode", "extend", "masked"])
def test_attention_layer_passes_its_window_and_cap(kind):
    """Attention(layer_id, sm_scale, window=, softcap=) stores k/v and attends with both."""
    head_dim, window, softcap = 16, 6, 1.5
    pool = _Pool([20, 9], 2, head_dim, seed=4)
    rows = pool.rows
    if kind == "decode":
        lens = torch.tensor([20, 9])
        fb = _fb(is_decode=True, req_to_token=pool.table, req_pool_indices=rows, seq_lens=lens,
                 out_slots=torch.stack([pool.table[rows[0], 19], pool.table[rows[1], 8]]).long())
        prefix, extend = [19, 8], [1, 1]
    elif kind == "extend":
        prefix, extend = [12, 0], [8, 9]
        fb = _fb(req_to_token=pool.table, req_pool_indices=rows,
                 prefix_lens=torch.tensor(prefix), extend_lens=torch.tensor(extend),
                 out_slots=torch.cat([pool.table[rows[0], 12:20], pool.table[rows[1], :9]]).long())
    else:
        prefix, extend = [12, 0], [8, 9]
        fb = _fb(req_to_token=pool.table, req_pool_indices=rows,
                 prefix_lens=torch.tensor(prefix), custom_masks=[
                     torch.ones(8, 8, dtype=torch.bool).tril(),
                     torch.ones(9, 9, dtype=torch.bool).tril()],
                 out_slots=torch.cat([pool.table[rows[0], 12:20], pool.table[rows[1], :9]]).long())
    t = sum(extend)
    q, k, v = pool.randn(t, 4, head_dim), pool.randn(t, 2, head_dim), pool.randn(t, 2, head_dim)
    kv = SimpleNamespace(k_buffers={3: pool.k}, v_buffers={3: pool.v}, k_scales=None,
                         v_scales=None)
    out = Attention(3, 0.6, window=window, softcap=softcap)(q, k, v, fb, kv)
    assert torch.equal(pool.k[fb.out_slots], k) and torch.equal(pool.v[fb.out_slots], v)
    _check_extend(out, q, pool, prefix, extend, 0.6, window, softcap)
    # and `attend` on its own, with nothing stored this time: the same call
    again = attend(q, pool.k, pool.v, fb, 0.6, window, softcap)
    assert torch.equal(again, out)


def test_positional_masks_window_by_position_and_see_later_keys():
    """An extend whose mask lets rows see later keys (an image's rows both ways) keeps, in a
    sliding layer, every key less than `window` positions before the query, later ones too
    (transformers' AND(window, OR(causal, block))); the same causal mask without the flag is
    the plain windowed extend."""
    import sglang_like_kernels as k

    head_dim, window = 16, 3
    pool = _Pool([10], 2, head_dim, seed=9)
    prefix, n = 2, 8
    q = torch.randn(n, 2, head_dim, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    mask[1:5, 1:5] = True  # rows 1..4 (positions 3..6) see each other
    got = k.masked_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor([prefix]),
                             [mask], 0.5, window=window, positional=torch.tensor([True]))
    keys = torch.arange(prefix + n)
    for i in range(n):
        qpos = prefix + i
        seen = torch.cat([torch.ones(prefix, dtype=torch.bool), mask[i]]) & (keys > qpos - window)
        slots = pool.table[pool.rows[0], keys[seen]].long()
        kk, vv = pool.k[slots].float(), pool.v[slots].float()  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[i].float(), kk) * 0.5
        want = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), vv)
        torch.testing.assert_close(got[i].float(), want, atol=1e-5, rtol=1e-5)
    causal = torch.ones(n, n, dtype=torch.bool).tril_()
    torch.testing.assert_close(
        k.masked_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor([prefix]),
                           [causal], 0.5, window=window, positional=torch.tensor([True])),
        k.extend_attention(q, pool.k, pool.v, pool.table, pool.rows, torch.tensor([prefix]),
                           torch.tensor([n]), 0.5, window=window), atol=1e-5, rtol=1e-5)
