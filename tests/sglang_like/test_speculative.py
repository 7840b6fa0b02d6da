"""Speculative decoding: trees, n-gram drafting, the settings, the masked attention a verify
runs, the cost controller; and on real models: greedy invariance (alone, in a mixed batch,
radix warm/cold, chunked prefill), lossless sampling, grammars, pool accounting."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import regex
import torch

import kernels
import kernels.cpu
from kernels import reference
from sglang_like.config import ServerArgs
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.speculative import DraftTree, SpecController, SpecState, ngram, resolve_spec_config
from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head, load_eagle3_head
from sglang_like.speculative.ngram import NgramDrafter, NgramIndex, RecentTexts

from .prompts import PROMPTS
from .spec_fakes import fake_batch, plain_step_to

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


def test_controller_compares_measured_rates_and_backs_off() -> None:
    ctl = SpecController()
    tree = DraftTree.chain(0, [1, 2, 3])  # no evidence: each draft expected at the prior 0.6
    assert ctl.choose_trees(1, [tree]) == [1]  # measure the plain step before judging
    ctl.record_forward(1, 0.020)
    assert ctl.choose_trees(1, [tree]) == [4]  # nothing measured above it: try the tree
    ctl.record_forward(4, 0.030)
    # 1 token in 20 ms (50/s); 1.6 in 23.3 (69), 1.96 in 26.7 (73.5), 2.18 in 30 (72.5):
    # the third draft costs more than it is expected to commit
    assert ctl.choose_trees(1, [tree]) == [3]
    ctl.record_forward(4, 0.070)  # 4 rows now cost 50 ms (the median of 30 and 70)
    assert ctl.choose_trees(1, [tree]) == [2]  # one draft: 1.6 tokens in 30 ms (53/s)
    ctl.record_forward(4, 0.070)  # 70 ms: 1.6 in 36.7 ms (44/s) is slower than plain
    assert ctl.choose_trees(1, [tree]) == [1]
    state = SpecState()
    for _ in range(15):
        ctl.record_drafted(state, kept=False)
    assert ctl.may_draft(state)
    ctl.record_drafted(state, kept=False)
    assert not ctl.may_draft(state)  # 16 steps of drafts turned down: drafting pauses
    ctl.step += 100
    assert ctl.may_draft(state)
    assert SpecController(enabled=False).choose_trees(1, [tree]) == [4]


def test_controller_pauses_a_batch_whose_drafting_does_not_pay_sooner() -> None:
    """A step whose drafting did not pay (for its batch as a whole) counts 4: the request
    pauses after 4 such steps, at any batch size; a draft turned down in a step whose
    drafting paid counts 1 (16 before a pause)."""
    ctl = SpecController()
    big, small = SpecState(), SpecState()
    for _ in range(3):
        ctl.record_drafted(big, kept=False, batch_pays=False)
        ctl.record_drafted(small, kept=False, batch_pays=False)
    assert ctl.may_draft(big) and ctl.may_draft(small)
    ctl.record_drafted(big, kept=False, batch_pays=False)
    assert not ctl.may_draft(big) and ctl.may_draft(small)
    ctl.record_drafted(small, kept=False, batch_pays=False)
    assert not ctl.may_draft(small)
    ctl, other = SpecController(), SpecState()  # (a new request would join the pause above)
    for _ in range(15):
        ctl.record_drafted(other, kept=False, batch_pays=True)
    assert ctl.may_draft(other)
    ctl.record_drafted(other, kept=False, batch_pays=True)
    assert not ctl.may_draft(other)


def test_controller_reads_unmeasured_sizes_off_measured_ones() -> None:
    """A row count never run is priced from the measured ones around it (linear), or above
    the largest by the average row cost over the measured range; with nothing to go on it is
    tried."""
    ctl = SpecController()
    ctl.record_forward(8, 0.020)
    assert ctl._cost_of(12) is None  # only the base measured: 12 rows are tried
    ctl.record_forward(16, 0.040)
    assert ctl._cost_of(12) == pytest.approx(0.030)
    assert ctl._cost_of(20) == pytest.approx(0.050)
    # a staircase (rows in blocks of 4): 17 and 18 rows cost the same, and 24 rows are priced
    # by the average row cost from 8 to 18 (3.5 ms), not as free
    ctl.record_forward(17, 0.055)
    ctl.record_forward(18, 0.055)
    assert ctl._cost_of(24) == pytest.approx(0.055 + 6 * 0.035 / 10)


def test_controller_never_prices_more_rows_below_fewer() -> None:
    """Measured a while apart on a drifting machine, 42 rows once read cheaper than the plain
    32 (32.3 against 34.5 ms): read as measured, drafting looked free. More rows cost at
    least what fewer were measured to cost; and from 8 rows up (compute-bound kernels) at
    least a share of an average row of the nearest smaller measured size per row more: 0.4
    of it at 8 rows, 0.75 at 16, a whole row from 32 (measured)."""
    ctl = SpecController()
    ctl.record_forward(4, 0.010)
    ctl.record_forward(5, 0.009)
    assert ctl._cost_of(5) == pytest.approx(0.010)  # below 8 rows: the running maximum only
    assert ctl._cost_of(6) == pytest.approx(0.010)
    ctl.record_forward(32, 0.0345)
    ctl.record_forward(42, 0.0323)
    per_row = 1.0 * 0.0345 / 32
    assert ctl._cost_of(42) == pytest.approx(0.0345 + 10 * per_row)
    assert ctl._cost_of(37) == pytest.approx(0.0345 + 5 * per_row)  # linear: 33.4 ms
    ctl.record_forward(56, 0.0600)
    assert ctl._cost_of(49) == pytest.approx(0.0323 + (0.0600 - 0.0323) * 7 / 14)
    assert ctl._cost_of(64) > ctl._cost_of(56) == pytest.approx(0.0600)
    # a confident drafter's sure nodes now cost rows, and with its drafting do not pay
    trees = [DraftTree([1, 2, 3], [-1, 0, 1], probs=[1.0, 0.6, 0.4]) for _ in range(5)]
    ctl.record_drafting(32, 0.0085)
    counts, pays = ctl.choose_nodes(32, trees)
    assert not pays


def test_rows_above_a_compute_bound_step_cost_a_measured_share_of_its_average_row() -> None:
    """Above a plain step of 8 or more rows a row more costs at least a share of the average
    row where it is added (0.75 at 8 rows, a whole row from 32: measured), priced off the
    plain step itself: a bigger size measured at a fast moment (48 rows at 45 ms against 40
    for 32) does not make trees look cheap. At batch 32 drafts of 0.8 are not verified; at
    batch 8 drafts of 0.95 are, of 0.6 not."""
    from sglang_like.speculative.step_costs import _min_row_share

    assert [_min_row_share(k) for k in (1, 8, 20, 32, 64)] == [
        0.75, 0.75, pytest.approx(0.875), 1.0, 1.0]
    ctl = SpecController()
    ctl.record_forward(32, 0.040)
    ctl.record_forward(48, 0.045)
    assert ctl._cost_above(32, 16) == pytest.approx(0.060)
    assert ctl._cost_above(32, 0) == pytest.approx(0.040)
    counts, rate = ctl._most_tokens_per_second(32, [[1.0, 0.8]] * 16)
    assert counts == [1] * 16 and rate == pytest.approx(32 / 0.040)
    ctl.record_forward(8, 0.012)
    ctl.record_forward(16, 0.0135)
    # each row r more adds share(r) of the average row at r: 8 rows and 8 more, 1.73x
    growth = 1.0
    for r in range(8, 16):
        growth *= 1 + _min_row_share(r) / r
    assert ctl._cost_above(8, 8) == pytest.approx(0.012 * growth) == pytest.approx(0.0207, rel=1e-2)
    assert ctl._cost_above(8, 24) > 0.012 * 3.3  # 32 rows: the share grows with the rows
    assert ctl._most_tokens_per_second(8, [[1.0, 0.95]] * 8)[0] == [2] * 8
    assert ctl._most_tokens_per_second(8, [[1.0, 0.6]] * 8)[0] == [1] * 8
    # from 32 rows no draft pays: a cheap drafter does not draft there
    assert ctl.rows_never_pay(32) and ctl.rows_never_pay(64) and not ctl.rows_never_pay(24)
    assert not SpecController(enabled=False).rows_never_pay(32)
    # without the floor (CUDA) the rows are priced as measured: 48 rows read cheap, and pay
    gpu = SpecController(row_share=None)
    gpu.record_forward(32, 0.040)
    gpu.record_forward(48, 0.045)
    assert not gpu.rows_never_pay(32) and gpu._cost_above(32, 16) == pytest.approx(0.045)
    assert gpu._most_tokens_per_second(32, [[1.0, 0.8]] * 16)[0] == [2] * 16


def test_cheap_drafter_trees_are_cut_where_their_depth_rates_stop_paying() -> None:
    """NGRAM's trees are priced by how often drafts at each depth were accepted after trees
    of the same evidence (match length), and cut to the nodes that pay; one unlucky tree
    does not price an evidence out."""
    ctl = SpecController()
    for rows in range(1, 7):
        ctl.record_forward(rows, 0.009 + 0.001 * rows)
    def chain(evidence):
        return DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4], evidence=evidence)
    def verify(committed, evidence):  # a new request's first verify (not copying yet)
        ctl.record_verify(SpecState(), committed, chain(evidence))
    for _ in range(20):
        verify(6, 6)  # long matches: every draft accepted
        verify(2, 2)  # two-token matches: the first draft only
    rates = ctl.depth_rates((2, False), 3)
    assert rates[0] > 0.9 and rates[1] < 0.15
    assert all(r > 0.9 for r in ctl.depth_rates((6, False), 5))
    # long: 5.4 tokens in 15 ms; two-token: 1.95 tokens in 11 ms, a second draft 0.12 more
    assert ctl.choose_trees(1, [chain(2)]) == [2]
    assert ctl.choose_trees(1, [chain(6)]) == [6]
    assert ctl.choose_trees(1, [chain(6), chain(2)]) == [6, 2]
    # a one-token match that failed once is still tried (its first draft 0.4 of a token for
    # 1 ms more; the second, untried, 0.4 of that)
    verify(1, 1)
    assert ctl.depth_rates((1, False), 2) == [pytest.approx(0.4), pytest.approx(0.4)]
    assert ctl.choose_trees(1, [chain(1)]) == [3]
    for _ in range(30):
        verify(1, 1)
    # ... until it keeps failing: 0.07 of a token is not worth a row at 10% of the step
    assert ctl.choose_trees(1, [chain(1)]) == [1]
    assert SpecController(enabled=False).choose_trees(1, [chain(1)]) == [6]


def test_cheap_drafter_prices_a_copying_request_apart() -> None:
    """Whether a request's last verified tree had a draft accepted is part of the evidence:
    short matches that fail in chat are still tried for a request that is copying."""
    ctl = SpecController()
    for rows in range(1, 7):
        ctl.record_forward(rows, 0.009 + 0.003 * rows)
    chatting, copying = SpecState(), SpecState()
    short = DraftTree([1, 2, 3], [-1, 0, 1], evidence=1)
    for _ in range(30):
        ctl.record_verify(chatting, 1, short)  # chat: one-token matches fail
    assert not chatting.copying
    for _ in range(30):  # a request copying its prompt: its one-token matches pay
        ctl.record_verify(copying, 3, short)
    assert copying.copying
    assert ctl.choose_trees(1, [short, short], [chatting, copying]) == [1, 3]
    ctl.record_verify(copying, 1, short)  # a miss: priced as a chatting request's again
    assert not copying.copying
    assert ctl.choose_trees(1, [short], [copying]) == [1]


def test_cheap_drafter_nodes_of_one_depth_share_its_chance() -> None:
    """In a trie of several continuations at most one node per depth is accepted: the
    nodes of a depth share the depth's chance, kept non-increasing in the tree's order."""
    ctl = SpecController()
    trie = DraftTree([0, 1, 2, 3, 4], [-1, 0, 1, 0, 3], evidence=3)  # two chains of two
    probs = ctl._cheap_node_probs(trie, (3, False))
    assert probs == pytest.approx([1.0, 0.3, 0.18, 0.18, 0.18])


def _eagle_tree(probs: list[float]) -> DraftTree:
    """A chain with the head's path probabilities `probs` (most likely first)."""
    n = len(probs) + 1
    return DraftTree(list(range(n)), list(range(-1, n - 1)), probs=[1.0, *probs])


def test_confident_drafts_are_kept_by_calibrated_probability_per_row_cost() -> None:
    """EAGLE's nodes are expected to commit their (calibrated) probability of a token; the
    step keeps the most likely nodes of all trees, as many as maximize its expected tokens
    per second; the calibration follows what verifies accepted against what the head
    predicted."""
    ctl = SpecController()
    likely, unlikely = _eagle_tree([0.9, 0.8, 0.6]), _eagle_tree([0.2, 0.1])
    assert ctl.choose_nodes(2, [likely, unlikely])[0] == [1, 1]  # nothing measured: plain first
    ctl.record_forward(2, 0.020)
    assert ctl.choose_nodes(2, [likely, unlikely])[0] == [4, 3]  # no cost known above: try all
    for rows, ms in ((3, 21), (4, 22), (5, 25), (6, 30), (7, 31)):
        ctl.record_forward(rows, ms / 1000)
    # expected tokens per ms with the m most likely nodes (0.9, 0.8, 0.6, 0.2, 0.1):
    # 2/20, 2.9/21, 3.7/22, 4.3/25 (the best: 0.172), 4.5/30, 4.6/31
    assert ctl.choose_nodes(2, [likely, unlikely])[0] == [4, 1]
    # the head turns out to be overconfident by half (1 accepted where it gave 2.0)
    for _ in range(200):
        ctl.record_verify(SpecState(), 2, _eagle_tree([0.8, 0.6, 0.4, 0.2]))
    assert ctl.draft_calibration == pytest.approx(0.5, rel=0.01)
    # now 0.45, 0.4, 0.3, ...: 2.45/21, 2.85/22 (the best: 0.130), 3.15/25 (0.126), ...
    assert ctl.choose_nodes(2, [likely, unlikely])[0] == [3, 1]
    assert ctl.min_draft_logprob() == pytest.approx(math.log(0.2), abs=1e-3)
    # whether drafting pays: the best (2.85 tokens in 22 ms) with the step's drafting added
    # against the plain step (2 tokens in 20 ms; costs are recorded without drafting)
    assert ctl.choose_nodes(2, [likely, unlikely])[1]  # nothing known of drafting
    ctl.record_drafting(2, 0.003)
    assert ctl.choose_nodes(2, [likely, unlikely])[1]  # 2.85 / 25 = 0.114 > 0.1
    ctl.record_drafting(4, 0.020)  # EMA of another size: 2 is still read off its own
    assert ctl.choose_nodes(2, [likely, unlikely])[1]
    ctl.record_drafting(2, 0.020)  # EMA: 3 -> 8.1 ms
    assert not ctl.choose_nodes(2, [likely, unlikely])[1]  # 2.85 / 30.1 = 0.095 < 0.1
    assert ctl._drafting_of(3) == pytest.approx(0.0081 * 3 / 2)  # the nearest size, scaled
    off = SpecController(enabled=False)
    assert off.choose_nodes(2, [likely, unlikely])[0] == [4, 3]
    assert off.min_draft_logprob() == -math.inf


def test_tree_first_nodes_are_a_subtree_with_their_probabilities() -> None:
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2], probs=[1.0, 0.7, 0.2, 0.5, 0.1])
    sub = tree.first(4)
    assert sub.tokens == [9, 1, 2, 3] and sub.parents == [-1, 0, 0, 1]
    assert sub.probs == [1.0, 0.7, 0.2, 0.5] and sub.depth == [0, 1, 1, 2]
    assert tree.first(9) is tree


def test_cheap_drafter_evidence_gone_stale_is_explored_once() -> None:
    """Trees whose evidence has not been verified for 256 steps are priced as untried again,
    one tree per evidence per step, once: then what they commit decides."""
    ctl = SpecController()
    ctl.record_forward(1, 0.010)
    ctl.record_forward(6, 0.016)
    trees = [DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4], evidence=4) for _ in range(2)]
    for _ in range(30):
        ctl.record_verify(SpecState(), 1, trees[0])  # at step 2: drafts turned down
    assert ctl.choose_trees(1, trees[:1]) == [1]  # not worth a row
    ctl.step = 2 + 257
    assert ctl.choose_trees(1, trees[:1]) == [4]  # stale: explored at the prior's rates
    assert ctl.choose_trees(1, trees[:1]) == [1]  # once
    ctl.step += 300
    counts = ctl.choose_trees(2, trees)
    assert sorted(counts)[0] == 1  # one tree of that evidence per step


def test_no_drafting_in_a_batch_where_no_row_can_pay() -> None:
    """From 32 plain rows on CPU a row more costs a whole average row: neither drafter
    drafts there (NGRAM's lookups, EAGLE's draft steps), and EAGLE's requests are held for
    32 steps (the head then stops extending over them), a hold new requests do not join: at
    8 rows both draft."""
    from types import SimpleNamespace

    from sglang_like.speculative.propose import propose_trees

    class Drafter:
        def __init__(self, cheap):
            self.drafts_cheaply, self.calls = cheap, 0

        def propose(self, reqs, depths, sched):
            self.calls += 1
            return [None for _ in reqs]

    def reqs(n):
        return [SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=100),
                                output_ids=[1], seq_len=10, is_decoding=True, spec=SpecState())
                for _ in range(n)]

    for cheap in (True, False):
        ctl = SpecController()
        ctl.record_forward(8, 0.02)
        ctl.record_forward(32, 0.04)
        drafter = Drafter(cheap)
        sched = SimpleNamespace(drafter=drafter, spec_controller=ctl,
                                config=SimpleNamespace(context_len=1000),
                                cache=SimpleNamespace(num_available_slots=1000))
        batch = reqs(32)
        for _ in range(4):
            assert propose_trees(sched, batch) == {}
        assert drafter.calls == 0
        if not cheap:
            assert all(not ctl.may_draft(r.spec) for r in batch)
            assert all(r.spec.backoff_until == 64 for r in batch)  # step 2 + 32, rounded up
            assert ctl.pauses_in_a_row == 0
        propose_trees(sched, reqs(8))
        assert drafter.calls == 1


def test_cheap_drafter_in_a_big_batch_drafts_rarely_while_its_trees_are_turned_down() -> None:
    """16 steps of a batch of 8 whose trees were all turned down: it drafts every 8th step
    only, until a tree is kept."""

    from sglang_like.speculative.propose import propose_trees

    calls = []

    class Drafter:
        drafts_cheaply = True

        def propose(self, reqs, depths, sched):
            calls.append(sched.spec_controller.step)
            return [DraftTree([1, 2, 3], [-1, 0, 1], evidence=1) for _ in reqs]

    ctl = SpecController()
    # such trees' drafts were turned down 100 times: never worth their rows
    ctl.depth_tried[(1, False)], ctl.depth_accepted[(1, False)] = [100.0, 0.0], [0.0, 0.0]
    ctl.record_forward(8, 0.02)
    ctl.record_forward(24, 0.04)
    sched, reqs = fake_batch(Drafter(), ctl)

    def step_to(step):
        plain_step_to(ctl, step)

    for step in range(1, 49):
        step_to(step)
        assert propose_trees(sched, reqs) == {}
    assert calls == [*range(1, 17), 24, 32, 40, 48]
    # now their drafts are accepted: kept on the next drafting step
    ctl.depth_tried[(1, False)], ctl.depth_accepted[(1, False)] = [100.0, 100.0], [100.0, 100.0]
    step_to(56)
    assert len(propose_trees(sched, reqs)) == 8 and ctl.cheap_idle_steps == 0
    step_to(57)
    propose_trees(sched, reqs)
    assert calls[-1] == 57
    # the plain step of 8 rows, last measured more than 32 steps ago, runs again before
    # any drafting (every tree is priced against it)
    n = len(calls)
    ctl.step = 57 + 33
    assert propose_trees(sched, reqs) == {} and len(calls) == n
    ctl.record_forward(8, 0.02)
    assert len(propose_trees(sched, reqs)) == 8 and len(calls) == n + 1


def test_controller_prices_rows_by_the_median_of_recent_steps() -> None:
    """A row count's price is the median of its last 5 steps: the slow first step after start
    does not hold it up for long (an average fed rarely did, and EAGLE drafted at a loss)."""
    ctl = SpecController()
    ctl.record_forward(1, 0.012)  # the first step: plans and buffers built
    assert ctl.cost[1] == 0.012
    for _ in range(2):
        ctl.record_forward(1, 0.006)
    assert ctl.cost[1] == 0.006
    for _ in range(5):
        ctl.record_forward(1, 0.005)
    assert ctl.cost[1] == 0.005


def test_controller_pauses_grow_and_end_together() -> None:
    """Pauses in a row (16 drafting steps with every draft turned down) double a request's
    pause; pauses end on multiples of 32 steps, so requests that paused at different steps
    retry in the same step; a step with a draft verified resets the doubling."""
    ctl = SpecController()
    a, b = SpecState(), SpecState()

    def turned_down(state: SpecState) -> None:
        for _ in range(16):
            ctl.record_drafted(state, kept=False)

    ctl.step = 5
    turned_down(a)
    ctl.step = 17
    turned_down(b)
    assert a.backoff_until == b.backoff_until == 64  # 5 + 32 and 17 + 32, rounded up
    ctl.step = 64
    assert ctl.may_draft(a) and ctl.may_draft(b)
    turned_down(a)  # second pause in a row: 64 steps
    assert a.backoff_until == 128
    ctl.step = 128
    turned_down(a)  # third: 128
    assert a.backoff_until == 256
    ctl.step = 256
    ctl.record_drafted(a, kept=True)  # a draft verified: the next pause is 32 steps again
    assert a.num_failed_tries == 0 and a.empty_steps == 0 and ctl.may_draft(a)
    turned_down(a)
    assert a.backoff_until == 288



def test_a_new_request_joins_the_confident_drafters_pause() -> None:
    """After pauses in a row, a request seen for the first time starts paused until the
    latest pause ends and backs off as long as the others next time; a step that kept a
    tree that paid ends that (new requests draft at once again)."""
    ctl = SpecController()
    first = SpecState()
    assert ctl.may_draft(first)  # nothing learnt yet
    ctl.step = 5
    for _ in range(4):
        ctl.record_drafted(first, kept=False, batch_pays=False)
    assert first.backoff_until == 64 and ctl.pauses_in_a_row == 1
    ctl.step = 40
    late = SpecState()
    assert not ctl.may_draft(late) and late.backoff_until == 64
    ctl.step = 64
    assert ctl.may_draft(late)
    for _ in range(4):
        ctl.record_drafted(late, kept=False, batch_pays=False)
    assert late.backoff_until == 128  # its second pause in a row: 64 steps
    ctl.step = 128
    ctl.record_drafted(late, kept=True)
    assert ctl.pauses_in_a_row == 0
    assert ctl.may_draft(SpecState())
    off = SpecController(enabled=False)
    off.pauses_in_a_row, off.pause_until = 3, 1000
    assert off.may_draft(SpecState())

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
    got = kernels.masked_attention(q, k_pool, v_pool, table, rows, prefix, causal, 0.25)
    want = reference.extend_attention(q, k_pool, v_pool, table, rows, prefix,
                                      torch.tensor(extra), 0.25)
    torch.testing.assert_close(got, want)
    # uniform trees: the tree verify reference agrees
    lens, extra = [6, 2], [4, 4]
    q, k_pool, v_pool, table = _pool_case(1, lens, extra)
    masks = [DraftTree([1, 2, 3, 4], [-1, 0, 0, 1]).mask(), DraftTree.chain(1, [2, 3, 4]).mask()]
    got = kernels.masked_attention(q, k_pool, v_pool, table, torch.arange(2), torch.tensor(lens),
                                   masks, 0.25)
    want = reference.tree_verify_attention(q, k_pool, v_pool, table, torch.arange(2),
                                           torch.tensor(lens), torch.stack(masks), 0.25)
    torch.testing.assert_close(got, want)


# ---- the head's files -------------------------------------------------------------------------


def _tiny_head_config(vocab: int = 96, hidden: int = 32) -> Eagle3Config:
    return Eagle3Config(hidden_size=hidden, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=vocab // 2,
                        target_hidden_size=hidden, aux_layer_ids=[0, 1, 1])


def test_head_round_trips_in_sglang_layout(tmp_path) -> None:
    torch.manual_seed(0)
    head = Eagle3Head(_tiny_head_config())
    head.d2t.copy_(torch.arange(48))  # draft id d -> target id 2d
    head.t2d[::2] = True
    head.save(str(tmp_path))
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "lm_head.weight", "d2t", "t2d", "norm.weight"} <= names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    back = load_eagle3_head(str(tmp_path))
    assert torch.equal(back.to_target_ids(torch.tensor([0, 5])), torch.tensor([0, 10]))
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3, msg=n)
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Other"]}))
    with pytest.raises(ValueError, match="EAGLE-3"):
        load_eagle3_head(str(tmp_path))


def test_aux_layer_ids_are_read_in_both_conventions_heads_ship(make_engine, tmp_path) -> None:
    """`eagle_aux_hidden_state_layer_ids` as SGLang reads it: ids starting at 1 are layer
    outputs (SpecForge-style [1, 14, 26] is the input of layers 2, 15, 27), others layer
    inputs (ours, [2, 15, 27]). The shipped head with its ids written the other way reads the
    same three layers; ids that are not three layers of the target are refused."""
    import shutil

    from sglang_like.speculative import DEFAULT_HEAD
    from sglang_like.speculative.eagle_head import capture_layer_ids

    assert capture_layer_ids([1, 14, 26]) == [2, 15, 27]
    assert capture_layer_ids([2, 15, 27]) == [2, 15, 27]
    assert capture_layer_ids([0, 1, 1]) == [0, 1, 1]
    assert capture_layer_ids([]) == []
    config = _tiny_head_config()
    config.aux_layer_ids = [1, 2, 3]  # layer 1's input: no way to write it that reads back
    with pytest.raises(ValueError, match="layer 1"):
        config.to_json()
    shipped = json.loads((Path(DEFAULT_HEAD) / "config.json").read_text())
    assert shipped["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]

    def head_with(ids: list[int], name: str) -> str:
        folder = tmp_path / name
        shutil.copytree(DEFAULT_HEAD, folder)
        cfg = dict(shipped, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        (folder / "config.json").write_text(json.dumps(cfg))
        return str(folder)

    prompts = HELD_OUT[:4]
    runs = {}
    for name, path in (("shipped", DEFAULT_HEAD), ("output-ids", head_with([1, 14, 26], "o"))):
        engine = make_engine(speculative_algorithm="EAGLE3", speculative_auto_disable=False,
                             speculative_draft_model_path=path, quantization=SPEC_QUANT)
        assert engine._client.core.runner.aux_layers == (2, 15, 27), name
        chat = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
        outs = engine.generate(chat, {"max_new_tokens": 32, "temperature": 0})
        runs[name] = [o["output_ids"] for o in outs]
        # the head drafts from these features: it commits more than a token per verify
        # (how many nodes a verify keeps depends on measured step times, so not exact)
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        assert tokens > 1.2 * sum(o["meta_info"]["spec_verify_ct"] for o in outs), name
        engine.shutdown()
    assert runs["output-ids"] == runs["shipped"]
    with pytest.raises(ValueError, match="not three layers"):
        make_engine(speculative_algorithm="EAGLE3", speculative_draft_model_path=head_with(
            [2, 15, 30], "past-the-end"))


def test_head_rope_settings_and_unsupported_variants(make_engine, tmp_path) -> None:
    """A head's RoPE as its config.json gives it, in either spelling transformers writes
    (Llama 3.1's "llama3" scaling under rope_parameters here), reaches the drafter's tables;
    the switches of SGLang's head variants this runtime does not run are refused by name."""
    from sglang_like.models.rotary import RotaryEmbedding

    folder = _random_head(str(tmp_path / "head"), 49152, 576, 30)
    config = json.loads((Path(folder) / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config.pop("rope_theta")
    (Path(folder) / "config.json").write_text(json.dumps(
        config | {"rope_parameters": {"rope_theta": 500000.0, **scaling}}))
    head = load_eagle3_head(folder)
    assert head.config.rope_theta == 500000.0 and head.config.rope_scaling == scaling
    engine = make_engine(speculative_algorithm="EAGLE3", speculative_draft_model_path=folder,
                         quantization=SPEC_QUANT)
    drafter = engine._client.core.scheduler.drafter
    rows = drafter.rope.cos_table.shape[0]
    d = head.config.head_dim
    want = RotaryEmbedding(d, rows, 500000.0, scaling, "cpu").cos_table
    plain = RotaryEmbedding(d, rows, 500000.0, None, "cpu").cos_table
    assert torch.equal(drafter.rope.cos_table, want) and not torch.equal(want, plain)
    assert len(engine.generate("Hi", {"max_new_tokens": 4, "temperature": 0})["output_ids"]) == 4
    engine.shutdown()
    for key, where in (("bias", "top"), ("norm_before_fc", "eagle_config"),
                       ("norm_before_fc", "top"), ("fc_norm", "top"), ("use_aux_norm", "top"),
                       ("norm_output", "top")):
        variant = dict(config)
        if where == "top":
            variant[key] = True
        else:
            variant["eagle_config"] = {**config["eagle_config"], key: True}
        (Path(folder) / "config.json").write_text(json.dumps(variant))
        with pytest.raises(ValueError, match=key):
            load_eagle3_head(folder)
    (Path(folder) / "config.json").write_text(json.dumps(config | {"num_aux_hidden_states": 4}))
    with pytest.raises(ValueError, match="4 target features"):
        load_eagle3_head(folder)


def test_eagle1_head_round_trips_in_sglang_layout(tmp_path) -> None:
    """SGLang's `LlamaForCausalLMEagle` checkpoint names (the EAGLE repository's: no `model.`
    prefix, fc with a bias, no input norm on the layer); a `model.` prefix and the extra
    tensors such files carry (the target's embedding, an input norm SGLang deletes) load too;
    `load_draft_head` dispatches on the architecture."""
    from safetensors.torch import load_file, save_file

    from sglang_like.speculative.eagle1_head import Eagle1Config, Eagle1Head
    from sglang_like.speculative.eagle_head import load_draft_head

    torch.manual_seed(0)
    head = Eagle1Head(Eagle1Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96))
    head.save(str(tmp_path))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} == (
        names - {"layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                 "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
                 "layers.0.mlp.up_proj.weight"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    back = load_draft_head(str(tmp_path))
    assert isinstance(back, Eagle1Head)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=n)
    tensors = {f"model.{k}": v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tensors |= {"model.embed_tokens.weight": torch.zeros(96, 32),
                "model.layers.0.input_layernorm.weight": torch.ones(32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert isinstance(load_draft_head(str(tmp_path)), Eagle1Head)
    del tensors["model.fc.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.bias"):
        load_draft_head(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"hot_vocab_size": 32}))
    with pytest.raises(ValueError, match="hot_vocab_size"):
        load_draft_head(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Other"]}))
    with pytest.raises(ValueError, match="EAGLE-1/2"):
        load_draft_head(str(tmp_path))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half RoPE of x [T, heads, D] at `positions` (written out for the test)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rolled = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return (x * cos[:, None, :].float() + rolled * sin[:, None, :].float())


@pytest.mark.slow
def test_eagle1_head_drafts_from_the_targets_last_hidden_state(make_engine, off_engine,
                                                               chat_prompts, tmp_path,
                                                               monkeypatch) -> None:
    """`--speculative-algorithm EAGLE` with an EAGLE-1/2 head (SGLang's layout; a random one
    for the default model). The target hands it its last hidden state after the norm (its LM
    head's input: the first output token is that row's argmax), and the head's first
    candidates after a prompt are those of the head written out densely here, as SGLang's
    `LlamaForCausalLMEagle` computes it: fc over [embedding, feature] with its bias, one
    layer without an input norm (causal attention with RoPE, GQA), the target's LM head with
    no norm before it. Greedy output equals speculation off, alone and in a batch."""
    from sglang_like.speculative.eagle1_head import Eagle1Config, Eagle1Head

    torch.manual_seed(1)
    target = off_engine.runner.model_config
    head = Eagle1Head(Eagle1Config(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, vocab_size=target.vocab_size,
        rope_theta=target.rope_theta))
    for p in head.parameters():  # a layer's scale, so the attention is not flat
        torch.nn.init.normal_(p, std=0.05) if p.dim() == 2 else torch.nn.init.normal_(p, 1.0, 0.1)
    head.save(str(tmp_path))
    engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="EAGLE",
                         speculative_draft_model_path=str(tmp_path),
                         speculative_auto_disable=False)
    drafter, model = engine.scheduler.drafter, engine.runner.model
    assert isinstance(drafter.head, Eagle1Head) and drafter.native is None
    assert engine.runner.aux_layers == (target.num_hidden_layers,)

    first: dict[str, object] = {}
    run_head = drafter._run_head

    def captured(fb, features, logit_rows):
        got = run_head(fb, features, logit_rows)
        first.setdefault("call", (fb, features.clone(), logit_rows, got))
        return got

    monkeypatch.setattr(drafter, "_run_head", captured)
    prompt = chat_prompts[1]
    out = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    fb, features, logit_rows, (outs, cand_ids, _) = first["call"]
    ids = engine.tokenizer.encode(prompt)
    n = len(ids)
    # the prompt's rows: tokens 1 .. n - 1 and the first output token, features 0 .. n - 1
    assert fb.input_ids.tolist() == ids[1:] + [out["output_ids"][0]]
    assert fb.positions.tolist() == list(range(n)) and features.shape == (n, target.hidden_size)
    assert int(model.lm_head(features[-1:]).argmax()) == out["output_ids"][0]
    # the head, densely
    c, w = head.config, {k: v.float() for k, v in head.state_dict().items()}
    emb = model.model.embed_tokens
    x = torch.cat([emb.method.embed(emb, fb.input_ids).float(), features], -1) @ w[
        "fc.weight"].T + w["fc.bias"]
    pos = torch.arange(n)
    q = _rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, -1, c.head_dim), pos,
              c.rope_theta)
    k = _rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, -1, c.head_dim), pos,
              c.rope_theta)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, -1, c.head_dim)
    g = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    r = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
    hn = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[
        "layers.0.post_attention_layernorm.weight"]
    mlp = (torch.nn.functional.silu(hn @ w["layers.0.mlp.gate_proj.weight"].T)
           * (hn @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
    dense = r + mlp
    cos = torch.nn.functional.cosine_similarity(outs, dense, dim=-1)
    assert cos.min() > 0.999, cos
    assert int(cand_ids[-1, 0]) == int(model.lm_head(dense[-1:]).argmax())

    # greedy output as without speculation, drafting at every step
    monkeypatch.undo()
    det = make_engine(**DETERMINISTIC, speculative_algorithm="EAGLE",
                      speculative_draft_model_path=str(tmp_path), speculative_auto_disable=False)
    plain = make_engine(**DETERMINISTIC)
    prompts = PROMPTS[:6] + chat_prompts
    want = [o["output_ids"] for o in plain.generate(prompts, GREEDY)]
    alone = [det.generate(p, GREEDY)["output_ids"] for p in prompts[::3]]
    assert _first_difference(alone, want[::3]) == []
    batched = det.generate(prompts, GREEDY)
    assert _first_difference([o["output_ids"] for o in batched], want) == []
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in batched)


# ---- the default model ------------------------------------------------------------------------

NEW_TOKENS = 64
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
SPEC = {
    "NGRAM": dict(speculative_algorithm="NGRAM"),
    # a random head proposes nonsense, a trained one good drafts: either way output is the
    # target's; the shipped head is used where it exists
    "EAGLE3": dict(speculative_algorithm="EAGLE3"),
}


def _random_head(folder: str, vocab: int, hidden: int, layers: int) -> str:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=vocab,
        target_hidden_size=hidden, aux_layer_ids=[0, layers // 2, layers - 1]))
    head.t2d[:] = True
    head.save(folder)
    return folder


def _spec_kwargs(name: str, tmp_path_factory) -> dict:
    kw = dict(SPEC[name], speculative_auto_disable=False)
    from sglang_like.speculative import DEFAULT_HEAD

    if name == "EAGLE3" and not (DEFAULT_HEAD and __import__("os").path.isfile(
            DEFAULT_HEAD + "/model.safetensors")):
        kw["speculative_draft_model_path"] = _random_head(
            str(tmp_path_factory.mktemp("head")), 49152, 576, 30)
    return kw


@pytest.fixture(scope="module")
def chat_prompts():
    from sglang_like.model_loader import load_tokenizer

    tok = load_tokenizer()
    asks = ["What is a radix tree?", "Write a haiku about rain.", "Name three planets.",
            "Copy this list exactly: apple, pear, plum, apple, pear, plum."]
    return [tok.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


# The weights these tests run: what `auto` picks on the default model, pinned so the engines
# with and without speculation run the same ones.
SPEC_QUANT = "int4"


@pytest.fixture(scope="module")
def off_engine(make_engine):
    return make_engine(quantization=SPEC_QUANT)


# Greedy invariance is asserted exactly, under --enable-deterministic-inference: there every
# token's row is computed by the same per-row sums in any batch, prefill chunk or verify, so a
# verify commits exactly what plain decode would. Without it, as in SGLang, the bf16
# activations of the int4 path let a different batch shape (a verify's rows, a prefill split
# differently) move a logprob by up to about 0.1 nats and part two outputs at a near-tie;
# speculation changes batch shapes, so only the deterministic mode can promise equal tokens.
DETERMINISTIC = dict(quantization=SPEC_QUANT, enable_deterministic_inference=True)


@pytest.fixture(scope="module")
def baseline(make_engine, chat_prompts):
    """Spec off, deterministic: (prompts, their ids generated in one batch)."""
    prompts = PROMPTS + chat_prompts
    off = make_engine(**DETERMINISTIC)
    return prompts, [o["output_ids"] for o in off.generate(prompts, GREEDY)]


def _first_difference(outputs, ids) -> list[tuple[int, int]]:
    """(request, first differing token) for every output unlike its baseline."""
    diffs = []
    for k, (got, want) in enumerate(zip(outputs, ids, strict=True)):
        assert len(got) == len(want), k
        i = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if i is not None:
            diffs.append((k, i))
    return diffs


def test_greedy_verifies_read_tokens_off_one_argmax(make_engine, off_engine, chat_prompts,
                                                     monkeypatch) -> None:
    """A verify whose requests all take their row's plain argmax walks its trees on one
    argmax over the verify's rows, without a sampler call per depth; a request asking for
    logprobs goes through the sampler at each node. The tokens are the same either way, and
    the plain decode's."""
    engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="NGRAM",
                         speculative_auto_disable=False)
    prompt = chat_prompts[3]  # copy a list: n-gram drafts are accepted
    params = {"max_new_tokens": 32, "temperature": 0}
    sampler = engine.scheduler.sampler
    calls: list[int] = []
    sample = sampler.sample

    def counted(logits, reqs, bitmask=None):
        calls.append(len(reqs))
        return sample(logits, reqs, bitmask)

    monkeypatch.setattr(sampler, "sample", counted)
    plain = engine.generate(prompt, params)
    greedy_calls, calls[:] = len(calls), []
    with_lp = engine.generate(prompt, params, return_logprob=True)
    want = off_engine.generate(prompt, params)["output_ids"]
    assert plain["output_ids"] == with_lp["output_ids"] == want
    verifies = plain["meta_info"]["spec_verify_ct"]
    assert verifies < len(want) - 4  # drafts were accepted
    assert greedy_calls <= 1  # the prompt's first token at most
    assert len(calls) >= len(want) - 1  # a sampler call per committed token with logprobs


@pytest.mark.slow
def test_ngram_drafts_from_an_earlier_request(make_engine, off_engine, chat_prompts) -> None:
    """A prompt asked again drafts from its first answer (finished requests' text), commits
    several tokens a verify, and answers the same as without speculation; a flushed cache
    forgets that text."""
    engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="NGRAM",
                         speculative_auto_disable=False)
    prompt = chat_prompts[1]
    want = off_engine.generate(prompt, GREEDY)["output_ids"]

    def run():
        out = engine.generate(prompt, GREEDY)
        assert out["output_ids"] == want
        return out["meta_info"]["completion_tokens"] / out["meta_info"]["spec_verify_ct"]

    first, again = run(), run()
    engine.flush_cache()
    forgotten = run()
    print(f"\nNGRAM acceptance: first {first:.2f}, again {again:.2f}, after a flush "
          f"{forgotten:.2f}")
    assert again > 2.5 and again > first + 1.0
    assert forgotten < again - 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["NGRAM", "EAGLE3"])
def test_greedy_equals_spec_off(make_engine, baseline, name, tmp_path_factory) -> None:
    """16 prompts x 64 tokens and 4 chat prompts, the same tokens as without speculation:
    alone (radix cold: every prompt is new to this engine; every 3rd prompt, to bound the
    time), all 20 in one batch (radix warm), and all 20 in a chunked-prefill engine (16-token
    chunks beside verifies) without the radix cache."""
    prompts, ids = baseline
    kw = _spec_kwargs(name, tmp_path_factory)
    engine = make_engine(**DETERMINISTIC, **kw)
    assert engine.server_args.quantization == SPEC_QUANT
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in prompts[::3]]
    assert _first_difference(alone, ids[::3]) == []
    batched = engine.generate(prompts, GREEDY)
    assert _first_difference([o["output_ids"] for o in batched], ids) == []
    assert sum(o["meta_info"]["cached_tokens"] for o in batched) > 0
    chunked = make_engine(chunked_prefill_size=16, disable_radix_cache=True, **DETERMINISTIC,
                          **kw)
    assert _first_difference([o["output_ids"] for o in chunked.generate(prompts, GREEDY)],
                             ids) == []
    hist = engine.get_server_info()["spec_accept_lengths"]
    assert sum(v for k, v in hist.items() if k > 1) > 0, hist  # some verify committed drafts
    # acceptance length as SGLang's clients compute it
    meta = [o["meta_info"] for o in batched]
    assert all(m["spec_verify_ct"] > 0 for m in meta)
    accept = sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)
    print(f"\n{name}: acceptance length {accept:.2f} (greedy, {len(prompts)} prompts)")
    if name == "NGRAM":
        assert accept > 1.05


def _mixed_batch(prompts: list[str]) -> tuple[list[str], list[dict]]:
    """Every kind of request at once: greedy, sampled (seeded), n > 1 samples, stop strings,
    logprobs, a regex and a JSON schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    rows = [
        (prompts[0], {"max_new_tokens": 40, "temperature": 0}),
        (prompts[1], {"max_new_tokens": 40, "temperature": 0.8, "seed": 7}),
        (prompts[2], {"max_new_tokens": 30, "temperature": 0, "stop": ["\n\n", "planet"]}),
        (prompts[3], {"max_new_tokens": 60, "temperature": 0}),
        ("Reply with a date: ", {"max_new_tokens": 12, "temperature": 0,
                                 "regex": r"\d{4}-\d{2}-\d{2}"}),
        ("A person as JSON: ", {"max_new_tokens": 40, "temperature": 0,
                                "json_schema": json.dumps(schema)}),
        (prompts[0], {"max_new_tokens": 24, "temperature": 0.7, "seed": 3, "n": 2}),
    ]
    return [r[0] for r in rows], [r[1] for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["NGRAM", "EAGLE3"])
def test_mixed_batch_with_grammars_equals_spec_off(make_engine, chat_prompts, name,
                                                   tmp_path_factory) -> None:
    """On the exact fp32 path, where a verify's float order cannot flip a token: every
    output, greedy or seeded sample, equals the one without speculation."""
    prompts, params = _mixed_batch(chat_prompts)
    engine = make_engine(quantization="none", **_spec_kwargs(name, tmp_path_factory))
    off_engine = make_engine(quantization="none")
    want = off_engine.generate(prompts, params, return_logprob=True)
    got = engine.generate(prompts, params, return_logprob=True)
    flat_params = [p for p in params for _ in range(p.get("n", 1))]
    assert len(got) == len(want) == len(flat_params)
    for g, w, p in zip(got, want, flat_params, strict=True):
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], (
            p, g["text"], w["text"])
        if "regex" in p:
            assert regex.fullmatch(p["regex"], g["text"]), g["text"]
        if "json_schema" in p:
            data = json.loads(g["text"])
            assert set(data) == {"name", "age"} and isinstance(data["age"], int)
        # greedy and seeded samples alike: each committed token consumes one draw of the
        # request's generator, in the same order as without speculation
        assert g["output_ids"] == w["output_ids"], (p, g["text"], w["text"])
        lp_g = [e[0] for e in g["meta_info"]["output_token_logprobs"]]
        lp_w = [e[0] for e in w["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp_g, lp_w, strict=True)) < 1e-3
    assert sum(engine.get_server_info()["spec_accept_lengths"].values()) > 0
    # without logprobs the grammars jump forward over forced text, between verifies
    rows = [i for i, p in enumerate(params) if "regex" in p or "json_schema" in p]
    sub_prompts, sub_params = [prompts[i] for i in rows], [params[i] for i in rows]
    jf_want = off_engine.generate(sub_prompts, sub_params)
    jf_got = engine.generate(sub_prompts, sub_params)
    assert [o["output_ids"] for o in jf_got] == [o["output_ids"] for o in jf_want]
    assert [o["text"] for o in jf_got] == [o["text"] for o in jf_want]


@pytest.mark.slow
def test_eagle_head_idles_in_a_batch_where_no_row_can_pay(make_engine, monkeypatch) -> None:
    """With the controller on, 32 requests at once are held before the head runs over their
    prompts (no tree could pay at 32 rows on CPU), and stay held to the end, past the end of
    a hold (32 steps) without catching up: the head runs over no row. Two requests
    afterwards draft (their prompts go through the head)."""
    engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="EAGLE3")
    drafter = engine.scheduler.drafter
    rows: list[int] = []
    original = drafter._run_head

    def counted(fb, features, logit_rows):
        rows.append(fb.input_ids.numel())
        return original(fb, features, logit_rows)

    monkeypatch.setattr(drafter, "_run_head", counted)
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(PROMPTS * 2, params)
    assert all(len(o["output_ids"]) == 48 for o in outs)
    assert rows == []
    engine.generate(PROMPTS[:2], params)
    print("DBG", rows, [o["meta_info"] for o in engine.generate(PROMPTS[:2], params)])
    assert sum(rows) > sum(len(engine.tokenizer.encode(p)) for p in PROMPTS[:2]) - 2


@pytest.mark.slow
def test_fused_head_call_is_the_single_ops(make_engine, monkeypatch) -> None:
    """Where the head's linears are x16 int4, a head forward with its LM head and top-k is
    one native call (eagle_head.c). Over the committed rows (fc over the target's features)
    and each draft step (the head's own outputs; a chain's read the request's own key row),
    it stores the same K/V and proposes the same candidates, with the same log-probabilities
    to float rounding, as the single ops (`NativeEagleHead.forward`, `logits`, torch's
    log-softmax and top-k) on the same inputs. The token embedding taken from the target's
    int8 rows, as they are or x16-packed, or given as floats: the same bits."""
    from kernels.cpu import ops

    engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="EAGLE3",
                         speculative_auto_disable=False)
    drafter = engine.scheduler.drafter
    if drafter.native is None or drafter.native.fused_ptrs is None:
        pytest.skip("the head's linears are not x16 int4 on this machine (AMX, or torch's)")
    pool_k, pool_v = drafter.pool.k_buffers[0], drafter.pool.v_buffers[0]
    run_head = drafter._run_head
    seen: list[tuple[int, int]] = []

    def compared(fb, features, logit_rows):
        k0, v0 = pool_k.clone(), pool_v.clone()
        got = run_head(fb, features, logit_rows)
        k1, v1 = pool_k.clone(), pool_v.clone()
        pool_k.copy_(k0)
        pool_v.copy_(v0)
        fused, drafter.native.fused_ptrs = drafter.native.fused_ptrs, None
        try:
            want = run_head(fb, features, logit_rows)
        finally:
            drafter.native.fused_ptrs = fused
        assert torch.equal(got[1], want[1]), (got[1], want[1])
        assert torch.allclose(got[2], want[2], atol=1e-4), (got[2], want[2])
        cos = torch.nn.functional.cosine_similarity(got[0], want[0], dim=-1)
        assert cos.min() > 0.9999, cos
        assert torch.equal(k1, pool_k) and torch.equal(v1, pool_v)
        seen.append((features.shape[1], fb.num_tokens))
        return got

    calls = []
    fused_op = ops.eagle_head_x16

    def captured(*args):
        calls.append(args)
        return fused_op(*args)

    monkeypatch.setattr(drafter, "_run_head", compared)
    monkeypatch.setattr(ops, "eagle_head_x16", captured)
    out = engine.generate(" ".join(PROMPTS), {"max_new_tokens": 32, "temperature": 0})
    assert out["meta_info"]["spec_verify_ct"] > 0
    hidden = engine.runner.model_config.hidden_size
    assert {f for f, _ in seen} == {3 * hidden, hidden}  # extends and draft steps
    assert max(t for f, t in seen if f == 3 * hidden) > 8  # the prompt's rows
    assert len(calls) == len(seen)  # each head forward one native call

    # one extend call again, its tokens embedded each way
    args = next(a for a in calls if a[1].shape[1] == 3 * hidden)
    emb = engine.runner.model.model.embed_tokens
    assert isinstance(args[0], tuple) and args[0][0] is emb.weight  # the target's rows
    ids = args[0][2]
    codes, scale = ((kernels.cpu.q8_x16_rows(emb.weight, emb.block_scale, ids))
                    if emb.weight.dim() == 5 else (emb.weight[ids], emb.block_scale[ids]))
    pad = -len(ids) % 16  # x16 packs 16 rows at a time
    packed = kernels.cpu.q8_x16_pack(torch.cat([codes, codes[:1].expand(pad, -1)]),
                                     torch.cat([scale, scale[:1].expand(pad, -1)]))
    local = torch.arange(len(ids))
    floats = emb.method.embed(emb, ids).float().contiguous()
    results = [fused_op(embeds, *args[1:]) for embeds in
               (floats, (codes.contiguous(), scale.contiguous(), local), (*packed, local))]
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))


@pytest.mark.slow
def test_a_paused_request_catches_the_head_up_over_what_it_skipped(make_engine,
                                                                   monkeypatch) -> None:
    """A request whose drafting is paused for its first steps (prompt and decode rows kept as
    bf16 features) has the head run over all of them when drafting resumes: the head's keys
    at every position then match those of a request that drafted all along (bf16 features,
    int8 activation blocks: close, not equal), where keys left unwritten would be far off."""
    def head_keys(paused_steps: int) -> tuple[list[int], torch.Tensor]:
        engine = make_engine(quantization=SPEC_QUANT, speculative_algorithm="EAGLE3",
                             speculative_auto_disable=False)
        sched, drafter = engine.scheduler, engine.scheduler.drafter
        ctl = sched.spec_controller
        may_draft = ctl.may_draft
        monkeypatch.setattr(ctl, "may_draft",
                            lambda state, ahead=0: ctl.step + ahead >= paused_steps
                            and may_draft(state, ahead))
        seen: dict[str, object] = {}
        after = drafter.after_forward

        def snapshot(batch, walks, s):
            after(batch, walks, s)
            req = batch.reqs[0]
            if not req.is_finished:  # the positions the head has run over so far
                n = req.kv_len - 1 if req.spec.eagle is not None else 0
                slots = s.cache.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
                seen["keys"] = drafter.pool.k_buffers[0][slots].clone()
                seen["ids"] = list(req.fill_ids)

        monkeypatch.setattr(drafter, "after_forward", snapshot)
        engine.generate(PROMPTS[3], {"max_new_tokens": 24, "temperature": 0})
        return seen["ids"], seen["keys"]

    ids_a, keys_a = head_keys(0)
    ids_b, keys_b = head_keys(10)
    n = min(len(keys_a), len(keys_b))
    assert ids_a[: n + 1] == ids_b[: n + 1] and n > 20
    a, b = keys_a[:n].flatten(1).float(), keys_b[:n].flatten(1).float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    assert cos.min() > 0.99, cos.min()


@pytest.mark.slow
def test_pool_accounting_with_speculation_aborts_and_retraction(make_engine) -> None:
    """A small pool (retraction), aborts mid-flight and speculation every step: the invariant
    is asserted after every step, and every slot comes back."""
    engine = make_engine(speculative_algorithm="NGRAM", speculative_auto_disable=False,
                         max_total_tokens=400, chunked_prefill_size=64)
    sched = engine.scheduler
    sched.config = dataclasses.replace(sched.config, check_accounting=True)
    rng = random.Random(0)
    prompts = [p + " " + p for p in PROMPTS[::2]]
    params = [{"max_new_tokens": rng.randint(8, 40), "temperature": 0} for _ in prompts]
    rids = [f"acct-{i}" for i in range(len(prompts))]
    import threading

    results = {}

    def run():
        results["out"] = engine.generate(prompts, params, rid=rids)

    t = threading.Thread(target=run)
    t.start()
    for rid in rids[::3]:
        engine.abort(rid)
    t.join(timeout=600)
    assert not t.is_alive()
    assert len(results["out"]) == len(prompts)
    assert engine.get_server_info()["num_running_reqs"] == 0
    assert engine.flush_cache()
    pool = engine.get_server_info()["kv_pool"]
    assert pool["free_slots"] == pool["total_slots"]
    sched.config = dataclasses.replace(sched.config, check_accounting=False)


# ---- lossless sampling on a tiny random model ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from sglang_like.model_loader import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-spec")
    tok = load_tokenizer()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # no attention output: the next token depends on the last one only
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _first_tokens(engine, prompt: list[int], seeds: range, k: int) -> list[tuple[int, ...]]:
    params = [{"max_new_tokens": k, "temperature": 1.0, "top_k": 3, "seed": s,
               "ignore_eos": True} for s in seeds]
    outs = engine.generate(input_ids=[prompt] * len(params), sampling_params=params)
    return [tuple(o["output_ids"]) for o in outs]


def _chi_square(a: list, b: list) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories seen, and its degrees of freedom."""
    cats = sorted(set(a) | set(b))
    ca = {c: a.count(c) for c in cats}
    cb = {c: b.count(c) for c in cats}
    na, nb = len(a), len(b)
    stat = 0.0
    for c in cats:
        tot = ca[c] + cb[c]
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (ca[c] - ea) ** 2 / ea + (cb[c] - eb) ** 2 / eb
    return stat, len(cats) - 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["NGRAM", "EAGLE3"])
def test_sampling_is_lossless_on_a_tiny_model(tiny_folder, name, tmp_path) -> None:
    """The joint distribution of the first 3 sampled tokens (top-k 3, temperature 1) with
    speculation on matches off: a chi-square test of homogeneity between independent seeds,
    at a fixed threshold (p < 0.001 fails)."""
    import sglang_like.engine_setup as setup_mod
    from sglang_like import Engine
    from sglang_like.model_loader import load_model

    kw = dict(speculative_algorithm=name, speculative_auto_disable=False)
    if name == "EAGLE3":
        kw["speculative_draft_model_path"] = _random_head(str(tmp_path / "head"), 49152, 64, 2)
    samples = 600
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setup_mod, "load_model", load_model)
        off = Engine(model_path=tiny_folder, quantization="none", max_total_tokens=8192)
        on = Engine(model_path=tiny_folder, quantization="none", max_total_tokens=8192, **kw)
    try:
        # The tiny model is a Markov chain over tokens (its attention is switched off). The
        # prompt holds, for each of the 3 tokens that can follow its end, that token and the
        # model's greedy walk from it: n-gram drafts are then likely continuations, so the
        # verifies both accept and reject
        start = off.tokenizer.encode("red green blue")
        top = off.generate(input_ids=start, sampling_params={"max_new_tokens": 1},
                           return_logprob=True, top_logprobs_num=3)
        prompt = []
        for _, tok, *_ in top["meta_info"]["output_top_logprobs"][0]:
            walk = off.generate(input_ids=[tok], sampling_params={"max_new_tokens": 3,
                                                                  "temperature": 0})
            prompt += [tok, *walk["output_ids"]]
        prompt += start
        a = _first_tokens(off, prompt, range(samples), 3)
        b = _first_tokens(on, prompt, range(samples, 2 * samples), 3)
        hist = on.get_server_info()["spec_accept_lengths"]
    finally:
        off.shutdown()
        on.shutdown()
    stat, dof = _chi_square(a, b)
    # the 0.999 quantile of chi-square(dof), Wilson-Hilferty
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    print(f"\n{name}: chi-square {stat:.1f} on {dof} dof (limit {limit:.1f}); verifies {hist}")
    assert stat < limit
    assert sum(hist.values()) >= samples  # every sample went through verify passes
    if name == "NGRAM":
        assert sum(v for k, v in hist.items() if k > 1) > samples // 20  # drafts got accepted


# ---- the shipped head ---------------------------------------------------------------------------

HELD_OUT = [  # written for this test; the head trained on conversations the model wrote itself
    "What is the tallest mountain in the world?",
    "How do I make a cup of green tea?",
    "Give me three tips for learning to play the guitar.",
    "What does a firefighter do?",
    "Explain what a rainbow is.",
    "Write a short poem about autumn leaves.",
    "Why do cats purr?",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a small bakery.",
    "How many days are there in a leap year?",
    "What are the colors of the French flag?",
    "Describe a sunset over the ocean.",
    "What is photosynthesis in simple words?",
    "List four animals that live in the Arctic.",
    "How can I improve my sleep?",
    "What is the difference between a lake and a sea?",
]
# Measured with the committed head (greedy, 64 new tokens, every step drafting a 3-token
# chain): 1.61 tokens per verify on a 2-core AMD EPYC, where the heads it was continued from
# measured 1.59, 1.50 and 1.45 (on an Intel Xeon the last two 1.48 and 1.42, the one
# before those, trained on 1/17 of the data, 1.31); a random head gives 1.00. The floor is
# that less a margin for another CPU's rounding in a different batch (or torch's head path
# where the native kernels are not built): it catches a broken, untrained or much weaker
# head, not a run's small gain. These prompts are written by people (none of them is in the
# head's data, whose everyday questions come from question frames, `chat_task`); the head's
# self-prompted conversations were written by the 135M model itself.
SHIPPED_HEAD_ACCEPT_FLOOR = 1.50


@pytest.mark.slow
def test_shipped_head_accepts_on_held_out_chat(make_engine) -> None:
    # the head's own drafts: without NGRAM's branch (tests/sglang_like/test_spec_copy_branch.py)
    engine = make_engine(speculative_algorithm="EAGLE3", speculative_auto_disable=False,
                         speculative_eagle_ngram_branch=False)
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in HELD_OUT]
    outs = engine.generate(prompts, {"max_new_tokens": 64, "temperature": 0})
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    accept = tokens / verifies
    print(f"\nshipped EAGLE-3 head: acceptance length {accept:.2f} on {len(prompts)} held-out "
          f"chat prompts ({tokens} tokens, {verifies} verify passes)")
    assert accept > SHIPPED_HEAD_ACCEPT_FLOOR
