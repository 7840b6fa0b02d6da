"""Speculation's parts without a model: draft trees, n-gram drafting (a request's own text,
recent requests' texts), the settings, and the masked attention a verify runs."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import sglang_like_kernels
import sglang_like_kernels.cpu
from sglang_like.config import ServerArgs
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.speculative import DraftTree, ngram, resolve_spec_config
from sglang_like.speculative.ngram import NgramDrafter, NgramIndex, RecentTexts
from sglang_like_kernels import reference

# ---- trees and drafting -----------------------------------------------------------------------


def test_tree_mask_depth_and_children() -> None:
    #        0
    #      1   2
    #      3
    tree = DraftTree([10, 11, 12, 13], [-1, 0, 0, 1])
    assert tree.depth == [0, 1, 1, 2]
    assert tree.child(0, 12) == 2 and tree.child(1, 13) == 3 and tree.child(2, 13) is None
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.mask(), want)
    cut = tree.truncated(1)
    assert cut.tokens == [10, 11, 12] and cut.parents == [-1, 0, 0]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])  # a node cannot be its own parent


def _req(ids: list[int], **sp) -> Req:
    return Req("r", ids, SamplingParams(max_new_tokens=sp.pop("max_new_tokens", 64), **sp))


def test_ngram_continues_the_longest_most_recent_match() -> None:
    index = NgramIndex(1, 4)
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    # "2 3 4" occurred twice before: the latest first (7 8 ...), then the earlier (5 9 ...)
    assert index.continuations(seq, 3, 2) == ([[7, 8, 2], [5, 9, 2]], 3)
    assert NgramIndex(2, 4).continuations([1, 2, 3, 4], 3, 1) == ([], 0)  # no earlier bigram


def _continuations_by_scan(seq, length, breadth, lo, hi):
    """NgramIndex.continuations by brute force: every earlier occurrence of each suffix
    (longest first, its last 4 occurrences, newest first)."""
    found, longest = [], 0
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        starts = [e + 1 for e in range(n - 1, len(seq) - 1) if seq[e - n + 1 : e + 1] == seq[-n:]]
        for start in reversed(starts[-4:]):
            cont = seq[start : start + min(length, 2 * n)]
            if cont and cont not in found:
                longest = longest or n
                found.append(cont)
                if len(found) >= breadth:
                    return found, longest
    return found, longest


def test_ngram_index_matches_a_brute_force_scan() -> None:
    """Integer-hashed n-grams (no tuples kept) find what a scan of the text finds, grown one
    token at a time as a decode grows it; a colliding hash is caught on read back."""
    rng = random.Random(0)
    for trial in range(40):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
        index = NgramIndex(1, 5)
        for cut in range(2, len(seq) + 1):
            want = _continuations_by_scan(seq[:cut], 6, 3, 1, 5)
            assert index.continuations(seq[:cut], 6, 3) == want, (trial, cut)
    index = NgramIndex(2, 3)
    seq = [1, 2, 9, 5, 6, 7, 1, 2]
    index.sync(seq)
    fake = next(h for n, h in ngram._suffix_hashes(seq, 5, 2, 2))  # "6 7" ends at 5
    real = next(h for n, h in ngram._suffix_hashes(seq, 7, 2, 2))  # "1 2": the suffix
    index.last_end[real] = index.last_end[fake]  # as if "1 2" hashed like "6 7"
    assert index.continuations(seq, 3, 1) == ([], 0)


def test_ngram_hashes_in_bulk_equal_the_ones_a_token_at_a_time() -> None:
    """A prompt's n-grams (and a finished text's) are hashed with numpy all at once: the
    same hashes in the same order as one at a time, so the tables come out the same."""
    rng = random.Random(1)
    for lo, hi in ((1, 12), (2, 5), (3, 3)):
        for length in (1, 2, 3, 17, 90):
            seq = [rng.randrange(49152) for _ in range(length)]
            want = [(h, e) for e in range(length - 1)
                    for _, h in ngram._suffix_hashes(seq, e, lo, hi)]
            keys, ends = ngram._all_hashes(seq, 0, length - 1, lo, hi)
            assert list(zip(keys, ends, strict=True)) == want
            keys, ends = ngram._all_hashes(seq, 9, length - 1, lo, hi)
            assert list(zip(keys, ends, strict=True)) == [(h, e) for h, e in want if e >= 9]
    seq = [rng.randrange(6) for _ in range(200)]
    bulk, one = NgramIndex(1, 5), NgramIndex(1, 5)
    bulk.sync(seq[:150])  # 149 new ends: the numpy path
    for cut in range(2, 151):
        one.sync(seq[:cut])  # one end at a time
    assert bulk.last_end == one.last_end and bulk.indexed == one.indexed == 149
    for cut in range(151, 201):
        assert bulk.continuations(seq[:cut], 6, 3) == _continuations_by_scan(
            seq[:cut], 6, 3, 1, 5)


def test_ngram_drafter_builds_a_capped_trie() -> None:
    drafter = NgramDrafter(num_draft_tokens=6, min_window=1, max_window=3, breadth=2)
    req = _req([5, 6, 7, 8, 5, 6, 9, 1, 5, 6])
    tree = drafter.propose([req], [10])[0]
    # the root is the last token; "5 6" continued latest with 9 1 5 6, earlier with 7 8 ...
    assert tree.tokens == [6, 9, 1, 5, 6, 7]  # capped at 6 nodes
    assert tree.parents == [-1, 0, 1, 2, 3, 0]
    assert drafter.propose([_req([1, 2, 3])], [10]) == [None]
    assert drafter.propose([req], [1])[0].max_depth == 1  # depth capped by the budget


def test_recent_texts_continue_the_newest_longest_match_within_capacity() -> None:
    recent = RecentTexts(1, 4, capacity=12)
    recent.add([1, 2, 3, 4, 5, 6])  # half the capacity: its generation is the old one now
    recent.add([9, 2, 3, 7, 8])  # newer: "2 3" now continues with 7 8
    assert recent.continuation([0, 2, 3], 5, 1) == ([7, 8], 2)
    assert recent.continuation([0, 1, 2, 3], 5, 1) == ([4, 5, 6], 3)  # the longer match
    assert recent.continuation([0, 1, 2, 3], 5, 4) == ([], 0)  # not longer than asked
    assert recent.continuation([5, 6], 5, 1) == ([], 0)  # a text's last token continues nowhere
    recent.add([4, 4, 1, 2])  # 15 tokens > 12: the old generation (the first text) goes
    assert recent.num_texts == 2 and recent.num_tokens == 9
    assert recent.continuation([0, 3, 4], 5, 1) == ([1, 2], 1)  # "4" now only in the newest
    assert recent.continuation([0, 2, 3], 5, 1) == ([7, 8], 2)
    assert recent.continuation([0, 4, 5], 5, 1) == ([], 0)
    recent.add([5, 6, 1])  # 12 tokens: all kept, the newest generation looked up first
    assert recent.continuation([0, 5], 5, 1) == ([6, 1], 1)
    assert recent.continuation([0, 4, 1], 5, 1) == ([2], 2)
    recent.add([8, 8, 8, 8])  # 16 > 12: the old generation goes whole, both its texts
    assert recent.num_texts == 2 and recent.num_tokens == 7
    assert recent.continuation([0, 4, 1], 5, 1) == ([], 0)
    assert recent.continuation([0, 2, 3], 5, 1) == ([], 0)
    assert recent.continuation([0, 6], 5, 1) == ([1], 1)
    recent.clear()
    assert recent.continuation([0, 8], 5, 1) == ([], 0) and recent.num_tokens == 0


def test_recent_texts_stay_within_capacity_and_keep_the_newest() -> None:
    rng = random.Random(0)
    recent = RecentTexts(1, 3, capacity=40)
    for i in range(300):
        text = [1000 + i] + [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        recent.add(text)
        assert recent.num_tokens <= 40
        # the newest text is never what makes room: its own tokens continue its own start
        assert recent.continuation([1000 + i], len(text), 1) == (text[1:3], 1)
        if i > 20:  # full: at least half the capacity less one text is kept
            assert recent.num_tokens >= 20 - 12


def test_ngram_drafter_drafts_from_finished_requests() -> None:
    drafter = NgramDrafter(num_draft_tokens=5, min_window=1, max_window=3, breadth=1,
                           capacity=100)
    done = _req([7, 1, 2, 3, 4, 5, 6])
    drafter.finished(done)
    tree = drafter.propose([_req([9, 9, 2, 3])], [10])[0]
    assert tree.tokens == [3, 4, 5, 6] and tree.evidence == -2  # another request's text
    own = _req([1, 2, 3, 8, 1, 2, 3])  # its own "1 2 3" is as long as the other's: own wins
    tree = drafter.propose([own], [10])[0]
    assert tree.tokens[:2] == [3, 8] and tree.evidence == 3
    drafter.flush()
    assert drafter.propose([_req([9, 9, 2, 3])], [10]) == [None]
    off = NgramDrafter(num_draft_tokens=5, min_window=1, max_window=3, breadth=1)
    off.finished(done)
    assert off.propose([_req([9, 9, 2, 3])], [10]) == [None]


def _tenant_req(ids: list[int], namespace: int | None) -> Any:
    req = _req(ids)
    req.cache_namespace = namespace
    return req


def test_ngram_drafts_only_from_its_own_tenants_texts() -> None:
    """Acceptance (spec_verify_ct, speed) would tell a tenant what another one wrote: a
    tenant's request drafts from its own tenant's finished texts only, the shared part's
    from the shared part's; at most TENANT_TEXTS tenants are kept."""
    drafter = NgramDrafter(num_draft_tokens=5, min_window=1, max_window=3, breadth=1,
                           capacity=80)
    drafter.finished(_tenant_req([7, 1, 2, 3, 4, 5, 6], namespace=11))
    assert drafter.propose([_tenant_req([9, 9, 2, 3], 22)], [10]) == [None]
    assert drafter.propose([_tenant_req([9, 9, 2, 3], None)], [10]) == [None]
    tree = drafter.propose([_tenant_req([9, 9, 2, 3], 11)], [10])[0]
    assert tree.tokens == [3, 4, 5, 6]
    for ns in range(100, 100 + NgramDrafter.TENANT_TEXTS):  # newer tenants push 11 out
        drafter.finished(_tenant_req([8, 8, 8], ns))
    assert drafter.propose([_tenant_req([9, 9, 2, 3], 11)], [10]) == [None]


def test_spec_config_defaults_and_errors() -> None:
    assert resolve_spec_config(ServerArgs(), True) is None
    ngram = resolve_spec_config(ServerArgs(speculative_algorithm="ngram"), True)
    assert ngram.algorithm == "NGRAM" and ngram.num_draft_tokens >= 2
    eagle = resolve_spec_config(ServerArgs(speculative_algorithm="EAGLE3"), True)
    assert eagle.draft_model_path.endswith("smollm2-135m-instruct-eagle3")
    assert (eagle.num_steps, eagle.eagle_topk, eagle.num_draft_tokens) == (3, 1, 4)
    tree = resolve_spec_config(ServerArgs(speculative_algorithm="EAGLE", speculative_num_steps=4,
                                          speculative_eagle_topk=2), True)
    assert tree.num_draft_tokens == 9
    bad = [dict(speculative_algorithm="MEDUSA"),
           dict(speculative_algorithm="EAGLE", speculative_eagle_topk=0),
           dict(speculative_algorithm="EAGLE", speculative_num_steps=2,
                speculative_eagle_topk=1, speculative_num_draft_tokens=8),
           dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                speculative_ngram_max_match_window_size=3),
           dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/nonexistent")]
    for kw in bad:
        with pytest.raises(ValueError):
            resolve_spec_config(ServerArgs(**kw), True)
    with pytest.raises(ValueError, match="draft-model-path"):
        resolve_spec_config(ServerArgs(speculative_algorithm="EAGLE3"), default_model=False)



# ---- the attention a verify runs ---------------------------------------------------------------


def _pool_case(seed: int, lens: list[int], extra: list[int]):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, 2, 16
    num_slots = sum(lens) + sum(extra) + 8
    k_pool = torch.randn(num_slots + 1, hkv, d, generator=g)
    v_pool = torch.randn(num_slots + 1, hkv, d, generator=g)
    table = torch.zeros(len(lens), 256, dtype=torch.int32)
    perm = (torch.randperm(num_slots, generator=g) + 1).tolist()
    for b, (n, e) in enumerate(zip(lens, extra, strict=True)):
        table[b, : n + e] = torch.tensor(perm[: n + e], dtype=torch.int32)
        perm = perm[n + e :]
    q = torch.randn(sum(extra), hq, d, generator=g)
    return q, k_pool, v_pool, table


def test_masked_attention_is_extend_under_causal_masks_and_tree_verify_under_trees() -> None:
    lens, extra = [5, 9, 0], [3, 4, 2]
    q, k_pool, v_pool, table = _pool_case(0, lens, extra)
    rows, prefix = torch.arange(3), torch.tensor(lens)
    causal = [torch.ones(e, e, dtype=torch.bool).tril() for e in extra]
    got = sglang_like_kernels.masked_attention(q, k_pool, v_pool, table, rows, prefix, causal, 0.25)
    want = reference.extend_attention(q, k_pool, v_pool, table, rows, prefix,
                                      torch.tensor(extra), 0.25)
    torch.testing.assert_close(got, want)
    # uniform trees: the tree verify reference agrees
    lens, extra = [6, 2], [4, 4]
    q, k_pool, v_pool, table = _pool_case(1, lens, extra)
    masks = [DraftTree([1, 2, 3, 4], [-1, 0, 0, 1]).mask(), DraftTree.chain(1, [2, 3, 4]).mask()]
    got = sglang_like_kernels.masked_attention(q, k_pool, v_pool, table, torch.arange(2),
                                               torch.tensor(lens), masks, 0.25)
    want = reference.tree_verify_attention(q, k_pool, v_pool, table, torch.arange(2),
                                           torch.tensor(lens), torch.stack(masks), 0.25)
    torch.testing.assert_close(got, want)
