"""The speculation controller on fake batches: step costs by row count, what drafts commit
(per evidence, calibrated), pauses and holds, which nodes a step verifies."""

from __future__ import annotations

import math

import pytest

from sglang_like.speculative import DraftTree, SpecController, SpecState

from .spec_fakes import decoding_reqs, fake_batch, plain_step_to


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

    class Drafter:
        def __init__(self, cheap):
            self.drafts_cheaply, self.calls = cheap, 0

        def propose(self, reqs, depths, ctx):
            self.calls += 1
            return [None for _ in reqs]

    for cheap in (True, False):
        ctl = SpecController()
        ctl.record_forward(8, 0.02)
        ctl.record_forward(32, 0.04)
        drafter = Drafter(cheap)
        propose, batch = fake_batch(drafter, ctl, size=32)
        for _ in range(4):
            assert propose(batch) == {}
        assert drafter.calls == 0
        if not cheap:
            assert all(not ctl.may_draft(r.spec) for r in batch)
            assert all(r.spec.backoff_until == 64 for r in batch)  # step 2 + 32, rounded up
            assert ctl.pauses_in_a_row == 0
        propose(decoding_reqs(8))
        assert drafter.calls == 1


def test_cheap_drafter_in_a_big_batch_drafts_rarely_while_its_trees_are_turned_down() -> None:
    """16 steps of a batch of 8 whose trees were all turned down: it drafts every 8th step
    only, until a tree is kept."""
    calls = []

    class Drafter:
        drafts_cheaply = True

        def propose(self, reqs, depths, ctx):
            calls.append(ctx.controller.step)
            return [DraftTree([1, 2, 3], [-1, 0, 1], evidence=1) for _ in reqs]

    ctl = SpecController()
    # such trees' drafts were turned down 100 times: never worth their rows
    ctl.depth_tried[(1, False)], ctl.depth_accepted[(1, False)] = [100.0, 0.0], [0.0, 0.0]
    ctl.record_forward(8, 0.02)
    ctl.record_forward(24, 0.04)
    propose, reqs = fake_batch(Drafter(), ctl)

    def step_to(step):
        plain_step_to(ctl, step)

    for step in range(1, 49):
        step_to(step)
        assert propose(reqs) == {}
    assert calls == [*range(1, 17), 24, 32, 40, 48]
    # now their drafts are accepted: kept on the next drafting step
    ctl.depth_tried[(1, False)], ctl.depth_accepted[(1, False)] = [100.0, 100.0], [100.0, 100.0]
    step_to(56)
    assert len(propose(reqs)) == 8 and ctl.cheap_idle_steps == 0
    step_to(57)
    propose(reqs)
    assert calls[-1] == 57
    # the plain step of 8 rows, last measured more than 32 steps ago, runs again before
    # any drafting (every tree is priced against it)
    n = len(calls)
    ctl.step = 57 + 33
    assert propose(reqs) == {} and len(calls) == n
    ctl.record_forward(8, 0.02)
    assert len(propose(reqs)) == 8 and len(calls) == n + 1


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
