"""The torch references against a naive one-query-at-a-time oracle (small shapes)."""

from __future__ import annotations

import math

import pytest
import torch

import sglang_like_kernels
from sglang_like_kernels import reference


def _naive_attend(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q_row [Hq, D]; keys/values [L, Hkv, D] (already the visible keys); fp64 result."""
    num_q_heads, head_dim = q_row.shape
    group = num_q_heads // keys.shape[1]
    out = torch.empty(num_q_heads, head_dim, dtype=torch.float64)
    for h in range(num_q_heads):
        k = keys[:, h // group].double()
        scores = k @ q_row[h].double() / math.sqrt(head_dim)
        out[h] = torch.softmax(scores, dim=0) @ values[:, h // group].double()
    return out


def _pools(num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_pool, v_pool, gen


def _table(lens: list[int], max_context: int, num_slots: int, gen: torch.Generator):
    """req_to_token with rows in reverse batch order, distinct random slots >= 1."""
    table = torch.randint(0, num_slots, (len(lens) + 1, max_context), dtype=torch.int32)
    perm = torch.randperm(num_slots - 1, generator=gen)[: sum(lens)] + 1
    rows = torch.arange(len(lens), 0, -1)
    start = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        table[row, :n] = perm[start : start + n].int()
        start += n
    return table, rows


CASES = [
    # lens, Hq, Hkv, D, dtype
    ([1, 7, 33], 4, 4, 16, torch.float32),
    ([5, 64, 2], 9, 3, 24, torch.float32),
    ([17, 1], 8, 1, 8, torch.bfloat16),
]


@pytest.mark.parametrize("lens,num_q_heads,num_kv_heads,head_dim,dtype", CASES)
def test_decode_matches_naive(lens, num_q_heads, num_kv_heads, head_dim, dtype):
    k_pool, v_pool, gen = _pools(200, num_kv_heads, head_dim, dtype, seed=1)
    table, rows = _table(lens, 80, 200, gen)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens)
    out = sglang_like_kernels.decode_attention(
        q, k_pool, v_pool, table, rows, seq_lens, 1 / math.sqrt(head_dim)
    )
    assert out.dtype == dtype and out.shape == q.shape
    for b, n in enumerate(lens):
        slots = table[rows[b], :n].long()
        want = _naive_attend(q[b], k_pool[slots], v_pool[slots])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].double(), want, rtol=tol, atol=tol)


SHARED_CASES = [
    # shared prefix length, per-request suffix lengths (query token included), Hq, Hkv
    (40, [1, 5, 30], 9, 3),
    (100, [2, 2, 9, 1], 8, 8),
    (33, [70], 4, 1),  # a group of one: plain path
]


@pytest.mark.parametrize("shared,suffixes,num_q_heads,num_kv_heads", SHARED_CASES)
def test_decode_cascade_over_shared_prefix(shared, suffixes, num_q_heads, num_kv_heads):
    """Rows that begin with the same slots (a radix-cache hit) take the cascade path, mixed
    with one unrelated request that takes the plain path; all must equal the oracle."""
    head_dim = 16
    k_pool, v_pool, gen = _pools(900, num_kv_heads, head_dim, torch.float32, seed=3)
    lens = [shared + n for n in suffixes] + [shared + 3]
    table, rows = _table(lens, 200, 900, gen)
    common = table[rows[0], :shared].clone()
    for b in range(len(suffixes)):
        table[rows[b], :shared] = common
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen)
    out = sglang_like_kernels.decode_attention(q, k_pool, v_pool, table, rows, torch.tensor(lens),
                                   1 / math.sqrt(head_dim))
    for b, n in enumerate(lens):
        slots = table[rows[b], :n].long()
        want = _naive_attend(q[b], k_pool[slots], v_pool[slots])
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)
    groups = reference._shared_prefix_groups(table[rows, : max(lens)].long(),
                                             torch.tensor(lens))
    assert [g[1] for g in groups] == ([shared] if len(suffixes) > 1 else [])


def _assert_extend_matches_naive(out, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens):
    """Query i of request b sees keys 0..prefix_len+i of its row, nothing else."""
    t = 0
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        for i in range(e):
            slots = table[rows[b], : p + i + 1].long()
            want = _naive_attend(q[t], k_pool[slots], v_pool[slots])
            torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-5)
            t += 1
    assert t == q.shape[0]


@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 3, 10], [4, 1, 6]), ([5], [0])])
def test_extend_matches_naive(prefix_lens, extend_lens):
    num_q_heads, num_kv_heads, head_dim = 6, 2, 16
    k_pool, v_pool, gen = _pools(100, num_kv_heads, head_dim, torch.float32, seed=2)
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    table, rows = _table(lens, 40, 100, gen)
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=gen)
    out = sglang_like_kernels.extend_attention(
        q,
        k_pool,
        v_pool,
        table,
        rows,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        1 / math.sqrt(head_dim),
    )
    _assert_extend_matches_naive(out, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens)


@pytest.mark.parametrize(
    "shared,private,extend_lens",
    [
        # members' cached prefixes: `shared` common slots + `private` own ones; last is unrelated
        (40, [0, 7, 3, 0], [5, 1, 12, 0]),
        (64, [2, 0], [30, 4]),
    ],
)
def test_extend_after_a_shared_prefix(shared, private, extend_lens):
    """Several requests extending after the same cached slots (n > 1 samples, a radix hit
    shared by a batch), beside one unrelated request, each see exactly their own keys."""
    num_q_heads, num_kv_heads, head_dim = 6, 2, 16
    k_pool, v_pool, gen = _pools(900, num_kv_heads, head_dim, torch.float32, seed=4)
    prefix_lens = [shared + p for p in private] + [shared + 5]
    extend_lens = extend_lens + [3]
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    table, rows = _table(lens, 200, 900, gen)
    common = table[rows[0], :shared].clone()
    for b in range(len(private)):
        table[rows[b], :shared] = common
    q = torch.randn(sum(extend_lens), num_q_heads, head_dim, generator=gen)
    out = sglang_like_kernels.extend_attention(q, k_pool, v_pool, table, rows,
                                               torch.tensor(prefix_lens),
                                               torch.tensor(extend_lens), 1 / math.sqrt(head_dim))
    _assert_extend_matches_naive(out, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens)


def test_tree_verify_matches_naive():
    num_q_heads, num_kv_heads, head_dim, num_draft = 4, 2, 8, 4
    prefix_lens = [3, 0, 9]
    k_pool, v_pool, gen = _pools(100, num_kv_heads, head_dim, torch.float32, seed=3)
    table, rows = _table([p + num_draft for p in prefix_lens], 20, 100, gen)
    # A chain 0 <- 1 and a branch 0 <- 2 <- 3, as a draft tree would give.
    parents = [-1, 0, 0, 2]
    mask = torch.eye(num_draft, dtype=torch.bool)
    for i, parent in enumerate(parents):
        while parent >= 0:
            mask[i, parent] = True
            parent = parents[parent]
    tree_mask = mask.expand(len(prefix_lens), -1, -1).clone()
    q = torch.randn(len(prefix_lens) * num_draft, num_q_heads, head_dim, generator=gen)
    out = sglang_like_kernels.tree_verify_attention(
        q,
        k_pool,
        v_pool,
        table,
        rows,
        torch.tensor(prefix_lens),
        tree_mask,
        1 / math.sqrt(head_dim),
    )
    for b, p in enumerate(prefix_lens):
        for i in range(num_draft):
            visible = list(range(p)) + [p + j for j in range(num_draft) if mask[i, j]]
            slots = table[rows[b], visible].long()
            want = _naive_attend(q[b * num_draft + i], k_pool[slots], v_pool[slots])
            torch.testing.assert_close(out[b * num_draft + i].double(), want, rtol=1e-5, atol=1e-5)


def test_store_kv_writes_only_given_slots():
    k_pool = torch.zeros(10, 2, 4, dtype=torch.bfloat16)
    v_pool = torch.zeros(10, 2, 4, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    slots = torch.tensor([7, 2, 5])
    sglang_like_kernels.store_kv(k_pool, v_pool, slots, k, v)
    torch.testing.assert_close(k_pool[slots], k.bfloat16())
    torch.testing.assert_close(v_pool[slots], v.bfloat16())
    untouched = [i for i in range(10) if i not in (7, 2, 5)]
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_bitmask_little_endian_bits(vocab):
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(3, vocab, generator=gen) < 0.5
    words = (vocab + 31) // 32
    padded = torch.zeros(3, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (padded.view(3, words, 32) * weights).sum(-1)
    bitmask = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    before = logits.clone()
    reference.apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits[allowed], before[allowed])
    assert torch.isneginf(logits[~allowed]).all()


def test_decode_plan_is_built_once_per_forward_and_rebuilt_after_writes(monkeypatch):
    """The model calls decode once per layer with the same tensors: the table-derived plan is
    built once; an in-place write to the table or the lengths makes it rebuild."""
    k_pool, v_pool, gen = _pools(300, 2, 8, torch.float32, seed=5)
    lens = [40, 40, 12]
    table, rows = _table(lens, 80, 300, gen)
    table[rows[1], :39] = table[rows[0], :39]
    seq_lens = torch.tensor(lens)
    q = torch.randn(3, 4, 8, generator=gen)
    calls = []
    real = reference._shared_prefix_groups
    monkeypatch.setattr(reference, "_shared_prefix_groups",
                        lambda *a: calls.append(1) or real(*a))

    def check():
        out = sglang_like_kernels.decode_attention(q, k_pool, v_pool, table, rows, seq_lens,
                                                   8**-0.5)
        for b in range(3):
            slots = table[rows[b], : int(seq_lens[b])].long()
            want = _naive_attend(q[b], k_pool[slots], v_pool[slots])
            torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)

    check()
    check()
    assert len(calls) == 1
    seq_lens[2] += 5  # in place: the plan must see the new length
    check()
    table[rows[1], :39] = table[rows[2], :39]  # the shared prefix is gone
    check()
    assert len(calls) == 3
