"""When to speculate: a measured cost model, so speculation is never a net slowdown.

A verify pass of N nodes per request costs more than a one-token decode (on CPU the int
kernels' time grows with rows), and a request whose drafts keep failing gains nothing. The
controller keeps what it measured: the step's wall time per number of token rows, and what
drafts committed (NGRAM: per matched length; EAGLE: accepted drafts against the head's own
probabilities of them, which makes those probabilities expected tokens). A step verifies the
drafts that give it the most expected tokens per second, none when plain decoding is faster.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_like.req import Req
    from sglang_like.scheduler import Scheduler
    from sglang_like.speculative.tree import DraftTree

# A confident drafter (EAGLE) gives every drafted node the head's probability of its path;
# scaled by what was measured (accepted drafts over the probabilities of the nodes verified,
# over every verify: `draft_calibration`), that is the node's expected share of a token.
# A beam below _DRAFT_MIN_PROB (scaled) is not drafted deeper: at batch 1 a head step costs
# about a twentieth of a target step, and such a node would not be verified anyway.
_DRAFT_MIN_PROB = 0.1
_CALIBRATION_EMA = 0.05
_CALIBRATION_RANGE = (0.25, 2.0)
# A request whose drafts were all turned down (or did not pay for the drafting: the head's
# extend and draft steps, measured per batch size) this many steps in a row pauses (the head
# stops extending over it; it catches up when drafting resumes) for _BACKOFF_STEPS, doubled
# per pause in a row (up to _MAX_BACKOFF_DOUBLINGS times); pauses end on multiples of
# _BACKOFF_STEPS, so paused requests of a batch retry together.
_EMPTY_STEPS = 16
# ... and a step whose drafting did not pay for itself (measured drafting cost; in a batch, as
# a whole) counts _UNPAID_WEIGHT such steps: in a batch of 32 a step's drafting is 15-40% of
# the step (16 of them before a pause cost a 96-token batch 20%: 0.77x of off), and since the
# fused decode step at batch 1 the head's extend and draft steps are ~2.4 ms of a ~6 ms step
_UNPAID_WEIGHT = 4
_BACKOFF_STEPS = 32
_MAX_BACKOFF_DOUBLINGS = 4
_EMA = 0.3
# a cheap drafter in a batch of at least _IDLE_MIN_BATCH requests whose trees were all turned
# down for _IDLE_STEPS steps in a row drafts only every _IDLE_PERIOD-th step until one is
# kept: drafting is a few lookups a request, but at batch 32 that was 1.2 ms of a 66 ms step
# for trees the step could not afford
_IDLE_MIN_BATCH = 8
_IDLE_STEPS = 16
_IDLE_PERIOD = 8
# A cheap drafter's (NGRAM) trees are priced by how often a draft at each depth was accepted
# (its parent accepted) after trees of the same evidence: counts decayed by _RATE_DECAY per
# verify of that evidence, each depth's rate smoothed towards the rate of the depth above it
# (depth 1: towards _PRIOR_RATE) with _PRIOR_WEIGHT verifies' weight, so a failure or two does
# not price an evidence out (its rate falls 0.6, 0.4, 0.3, 0.25, ...). A tree is then cut to
# the nodes that pay. (An EMA of tokens per tree, started at the first verify of a match
# length, priced a length by one unlucky tree for good: on the bench's extraction prompts
# one-token matches committed nothing once and were never drafted again, 1.73 tokens per
# verify where drafting every tree gave 2.24.)
_PRIOR_RATE = 0.6
_PRIOR_WEIGHT = 2.0
_RATE_DECAY = 0.95
# a cheap drafter's evidence whose trees have not been verified for this many steps is
# expected to do as well as an untried one, once (the text changes: the bench's code-editing
# prompts after chat found their match lengths priced by chat's trees and never drafted)
_STALE_EVIDENCE_STEPS = 256
# the plain step of a batch size is measured again when its last measurement is this many
# steps old: every tree is priced against it, and a drafter that drafts at every step never
# runs one otherwise (measured: the batch-1 plain step kept the 8.7 ms of a step just after
# start while it ran in 5.8, and EAGLE drafted at 0.85x of plain decoding)
_REMEASURE_STEPS = 32
# From _COMPUTE_BOUND_ROWS rows up the int kernels are compute-bound (the x16 kernel runs 8
# activation rows per pass over the weights; more rows, more passes). Sizes measured a while
# apart on a drifting machine read rows there as nearly free (NGRAM's one-token matches, 0.14
# tokens a node, were verified at batch 32: 0.78x of off; at batch 32 a plain step once read
# 77 ms and 32 ms in one run), so a size above a measured one k of at least that many rows is
# priced at least at k's cost grown row by row, each row r more adding a share of the average
# row at r, the share read off _ROW_SHARE (linear between its sizes, its last share above
# them; `SpecController._growth`): what a row more cost against an average row. Measured two
# ways on a 2-core AMD EPYC, int4: a verify's tree rows over a batch of 8 (NGRAM always on,
# the bench's code prompts, step times by row count in one run): 0.75-0.8 from 8 rows to
# 14-30, about 0.86 from 20 to 30; and more requests' decode rows with the steps of each pair
# back to back (scripts/bench_row_cost.py, 5 rounds, medians): 0.39 from 8 rows to 12 (spread
# 0.17-0.61), 0.77 from 16 to 24, 1.07 from 32 to 48 (1 to 4: 0.13). A flat half a row priced
# NGRAM's 0.69 tokens a row at batch 32 as paying: 818 rows bought 568 tokens, 0.95x of off;
# 0.4 at 8 rows verified 1.38-1.41 tokens per verify at batch 8 at 0.82-0.88x of off.
_COMPUTE_BOUND_ROWS = 8
_ROW_SHARE = ((8, 0.75), (32, 1.0))
# a row count's cost is the median of its last _COST_SAMPLES steps: an EMA started from the
# first step after start (12 ms where the step runs in 5.8: plans and buffers built) and fed
# a plain step every _REMEASURE_STEPS kept the plain step's price 30-40% high for a hundred
# steps, and EAGLE verified trees that did not pay
_COST_SAMPLES = 5


def _backoff_end(step: int) -> int:
    """`step` rounded up to a multiple of _BACKOFF_STEPS: pauses end together."""
    return -(-step // _BACKOFF_STEPS) * _BACKOFF_STEPS


def _min_row_share(rows: int, table: tuple[tuple[int, float], ...] = _ROW_SHARE) -> float:
    """The least share of an average row a row more costs above a step of `rows` rows."""
    (k0, s0) = table[0]
    if rows <= k0:
        return s0
    for k1, s1 in table[1:]:
        if rows <= k1:
            return s0 + (s1 - s0) * (rows - k0) / (k1 - k0)
        k0, s0 = k1, s1
    return s0


@dataclass
class SpecState:
    """Per-request speculation state (lives on the Req)."""

    verify_ct: int = 0  # decode forwards of this request (plain or tree): SGLang's spec_verify_ct
    accepted_drafts: int = 0  # drafted tokens the target kept
    backoff_until: int = 0  # the controller's step count before which it does not draft
    num_failed_tries: int = 0  # pauses in a row since a tree was last verified
    empty_steps: int = 0  # steps in a row whose drafts were all turned down (confident drafter)
    copying: bool = False  # its last verified cheap tree had a draft accepted (_evidence_key)
    joined: bool = False  # the controller has seen it (a new one starts in the batch's pause)
    ngram: object | None = None  # NgramIndex
    eagle: object | None = None  # EAGLE drafter state: next-step candidates, feature
    eagle_pending: object | None = None  # (first position, target features) not yet drafted


def _ema(old: float | None, value: float, weight: float = _EMA) -> float:
    return value if old is None else (1 - weight) * old + weight * value


def _bucket(num_rows: int) -> int:
    return num_rows if num_rows <= 64 else 1 << math.ceil(math.log2(num_rows))


_MAX_EVIDENCE = 8  # match lengths from here on share one expectation


def _evidence_key(evidence: int, copying: bool) -> tuple[int, bool]:
    """A tree's evidence as the key of its expectation: NGRAM's match length, negative when
    the match was in another request's text (lengths from _MAX_EVIDENCE on share one), and
    whether the request's last verified tree had a draft accepted. Drafts are accepted in
    runs: a request copying its prompt (extraction, editing) keeps matching, and one chatting
    matches now and then by chance. Measured on the bench, after its chat prompts had priced
    short matches at 0.07 a draft, extraction's short matches (0.44 there) were not tried
    again; with the bit they are priced as a copying request's, once a long match paid."""
    return max(-_MAX_EVIDENCE, min(evidence, _MAX_EVIDENCE)), copying


@dataclass
class SpecController:
    enabled: bool = True  # False: always speculate where a draft exists (tests, benchmarks)
    # the least share of an average row a row more costs above a compute-bound plain step
    # (see _ROW_SHARE, measured on CPU); None: no such floor (CUDA, where rows are cheap)
    row_share: tuple[tuple[int, float], ...] | None = _ROW_SHARE
    step: int = 0
    cost: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds (median)
    cost_step: dict[int, int] = field(default_factory=dict)  # rows bucket -> step measured
    _cost_samples: dict[int, deque] = field(default_factory=dict)
    # a cheap drafter's trees by their evidence key (NGRAM: matched length) -> per depth d
    # (index d - 1): decayed counts of verifies that tried a draft at depth d, and that
    # accepted one (see _PRIOR_RATE)
    depth_tried: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    depth_accepted: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    # a confident drafter's (EAGLE) accepted drafts and the probabilities the head gave the
    # nodes verified, per verify (EMAs over every request; equal at start: the head is taken
    # at its word until measured)
    drafts_accepted: float = 1.0
    drafts_predicted: float = 1.0
    # batch-size bucket -> seconds a step spent drafting (EAGLE: the head's extend after the
    # forward and its draft steps; EMA): sunk in every step's measured cost, it is what a
    # step without speculation would not pay
    drafting: dict[int, float] = field(default_factory=dict)
    drafted_step: int = -1  # the last step a confident drafter drafted a tree in
    # a confident drafter's most pauses in a row of one request since a step last kept a
    # tree that paid, and the step the latest pause ends: a new request joins that pause
    # and backs off as long as the others, instead of learning afresh what the one before
    # it learnt (EAGLE over the bench's batch-1 prompts, one after another: 95 / 45 / 8
    # drafting steps on chat / extraction / code, where each request starting afresh
    # drafted in 158 / 133 / 92)
    pauses_in_a_row: int = 0
    pause_until: int = 0
    # steps in a row whose cheap trees were all turned down (see _IDLE_STEPS)
    cheap_idle_steps: int = 0
    # evidence key -> the step its trees were last verified (or last explored)
    evidence_step: dict[tuple[int, bool], int] = field(default_factory=dict)
    # _growth's values by row count, extended as asked
    _growth_of: list[float] = field(default_factory=lambda: [1.0])
    # the measured sizes in order, and the most any of them up to each costs (see _cost_of);
    # derived from `cost` when first read after a step (every step records, speculating or
    # not; few steps read it)
    _floors: tuple[list[int], list[float]] | None = None

    def record_forward(self, num_rows: int, seconds: float) -> None:
        self.step += 1
        b = _bucket(num_rows)
        samples = self._cost_samples.setdefault(b, deque(maxlen=_COST_SAMPLES))
        samples.append(seconds)
        self.cost[b] = statistics.median(samples)
        self.cost_step[b] = self.step
        self._floors = None

    def plain_step_stale(self, base_rows: int) -> bool:
        """Whether this step should run plain, to measure again the step of `base_rows`
        rows that every tree is priced against (see _REMEASURE_STEPS)."""
        last = self.cost_step.get(_bucket(base_rows))
        return self.enabled and last is not None and self.step - last > _REMEASURE_STEPS

    def record_drafting(self, batch_size: int, seconds: float) -> None:
        b = _bucket(batch_size)
        self.drafting[b] = _ema(self.drafting.get(b), seconds)

    def _drafting_of(self, batch_size: int) -> float:
        """A step's drafting at this batch size: measured, or the nearest measured size's
        scaled by the number of requests (a batch that shrinks as requests finish meets a
        new size every step; unmeasured, it would look free)."""
        b = _bucket(batch_size)
        if b in self.drafting or not self.drafting:
            return self.drafting.get(b, 0.0)
        near = min(self.drafting, key=lambda k: abs(k - b))
        return self.drafting[near] * b / near

    def record_verify(self, state: SpecState, committed: int, tree: DraftTree,
                      path: list[int] | None = None) -> None:
        """A verify of `tree` committed `committed` tokens (its root's bonus included):
        `path`, the nodes committed (root first), is needed for a grafted tree
        (`DraftTree.copied`), whose two drafters are measured each on its own nodes."""
        if tree.copied is not None:
            if path is None:
                raise ValueError("a grafted tree's verify needs the nodes it committed")
            took = path[1:]
            copies = [d for d, c in zip(tree.depth, tree.copied, strict=True) if c]
            if copies and tree.evidence is not None:
                # the cheap drafter's drafts are a subtree: those taken are a prefix of it
                self._record_evidence(state, tree.evidence,
                                      1 + sum(tree.copied[j] for j in took), max(copies))
            predicted = sum(tree.probs[1:]) if tree.probs is not None else 0.0
            if predicted > 0.0:
                self._record_calibration(sum(tree.probs[j] > 0.0 for j in took), predicted)
            return
        if tree.evidence is not None:
            self._record_evidence(state, tree.evidence, committed, tree.max_depth)
        if tree.probs is not None:
            self._record_calibration(committed - 1, sum(tree.probs[1:]))

    def _record_evidence(self, state: SpecState, evidence: int, committed: int,
                         depth: int) -> None:
        """A cheap drafter's tree of `evidence` and `depth` committed `committed` of its
        drafts' tokens, root's included (see _PRIOR_RATE)."""
        key = _evidence_key(evidence, state.copying)
        state.copying = committed > 1
        tried = self.depth_tried.setdefault(key, [])
        accepted = self.depth_accepted.setdefault(key, [])
        for counts in (tried, accepted):
            counts.extend([0.0] * (depth - len(counts)))
            counts[:] = [c * _RATE_DECAY for c in counts]
        # drafts at depths 1 .. committed - 1 were accepted; the next depth (if drafted)
        # was tried and turned down; deeper ones were not tried
        for d in range(min(committed, depth + 1) - 1):
            tried[d] += 1.0
            accepted[d] += 1.0
        if committed <= depth:
            tried[committed - 1] += 1.0
        self.evidence_step[key] = self.step

    def _record_calibration(self, accepted: float, predicted: float) -> None:
        """A confident drafter's verify: `accepted` of its drafts taken, where the head's
        probabilities of the nodes verified summed to `predicted`."""
        w = _CALIBRATION_EMA
        self.drafts_accepted = (1 - w) * self.drafts_accepted + w * accepted
        self.drafts_predicted = (1 - w) * self.drafts_predicted + w * predicted

    @property
    def draft_calibration(self) -> float:
        """Accepted drafts per unit of the head's probability, as measured (clamped)."""
        low, high = _CALIBRATION_RANGE
        return min(high, max(low, self.drafts_accepted / max(self.drafts_predicted, 1e-9)))

    def min_draft_logprob(self) -> float:
        """A confident drafter's beam whose log-probability is below this is not drafted
        deeper (-inf with the controller off)."""
        if not self.enabled:
            return -math.inf
        return math.log(_DRAFT_MIN_PROB / self.draft_calibration)

    def record_drafted(self, state: SpecState, kept: bool, batch_pays: bool = True) -> None:
        """A confident drafter drafted for this request; `kept`: a node was verified and the
        step's drafting paid (`batch_pays`: it did, for the step's batch as a whole; a step
        that did not counts _UNPAID_WEIGHT). After _EMPTY_STEPS in a row without, the
        request pauses (see the module's constants)."""
        if kept:
            state.empty_steps = state.num_failed_tries = 0
            self.pauses_in_a_row = self.pause_until = 0
            return
        state.empty_steps += 1 if batch_pays else _UNPAID_WEIGHT
        if self.enabled and state.empty_steps >= _EMPTY_STEPS:
            state.empty_steps = 0
            self._pause(state)

    def _pause(self, state: SpecState) -> None:
        """Pause `state` for _BACKOFF_STEPS << failures in a row, ending on a multiple of
        _BACKOFF_STEPS (see the module's constants)."""
        steps = _BACKOFF_STEPS << min(state.num_failed_tries, _MAX_BACKOFF_DOUBLINGS)
        state.num_failed_tries += 1
        state.backoff_until = _backoff_end(self.step + steps)
        self.pauses_in_a_row = max(self.pauses_in_a_row, state.num_failed_tries)
        self.pause_until = max(self.pause_until, state.backoff_until)

    def hold(self, state: SpecState) -> None:
        """Pause `state` until the next multiple of _BACKOFF_STEPS at least _BACKOFF_STEPS
        away, for its batch's size (not for its drafts: no doubling, and new requests do
        not join it)."""
        state.backoff_until = max(state.backoff_until, _backoff_end(self.step + _BACKOFF_STEPS))

    def may_draft(self, state: SpecState, ahead: int = 0) -> bool:
        """Whether the request may draft `ahead` steps from now. A request seen for the
        first time joins the confident drafter's current pause (see `pauses_in_a_row`)."""
        if not state.joined:
            state.joined = True
            if self.pauses_in_a_row and not state.num_failed_tries:
                state.num_failed_tries = self.pauses_in_a_row
                state.backoff_until = self.pause_until
        return not self.enabled or self.step + ahead >= state.backoff_until

    def _cheap_idles(self, batch_size: int) -> bool:
        """Whether a cheap drafter skips this step: in a batch of at least _IDLE_MIN_BATCH
        whose cheap trees were all turned down _IDLE_STEPS steps in a row, it drafts only
        every _IDLE_PERIOD-th step."""
        return (self.enabled and batch_size >= _IDLE_MIN_BATCH
                and self.cheap_idle_steps >= _IDLE_STEPS and not self._on_multiple(_IDLE_PERIOD))

    def _on_multiple(self, period: int, ahead: int = 0) -> bool:
        """Whether one of this step and the `ahead` after it is a multiple of `period`."""
        return any((self.step + a) % period == 0 for a in range(ahead + 1))

    def _cost_of(self, rows: int) -> float | None:
        """The measured cost of that many rows, or one read off the nearest measured sizes
        (linear between the two around it; above the largest, growing from it by the average
        cost of a row between the smallest and the largest measured): every new row count is
        not worth a try of its own. None when no size from `rows` up has been measured and
        fewer than two below it have.

        Why the average and not the last two sizes' slope: torch's int4 kernel runs rows in
        blocks of 4, so cost is a staircase (measured at batch 1, int4: 11.2 ms for 4 rows,
        16.1 for 5, 18.8 for 8, 26.8 for 9); two sizes on one stair read as free rows (after
        batch-1 runs 10 and 11 rows measured 28.7 and 28.3 ms, which priced 13 rows at 28
        ms; they cost 33-38).

        Never less than a smaller size was measured to cost: more rows are never cheaper,
        but steps measured a while apart on a machine whose speed drifts 10-20% say so (at
        batch 32, 42 rows read 32.3 ms against 34.5 for the plain 32: drafting looked free,
        paid on paper, reset EAGLE's pause, and the batch ran at 0.73x of off)."""
        b = _bucket(rows)
        if b in self.cost:
            return self._at_least_below(b, self.cost[b])
        below = [k for k in self.cost if k < b]
        above = [k for k in self.cost if k > b]
        if below and above:
            lo, hi = max(below), min(above)
            value = self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (b - lo) / (hi - lo)
            return self._at_least_below(b, value)
        if len(below) >= 2 and not above:
            lo, hi = min(below), max(below)
            slope = max(0.0, (self.cost[hi] - self.cost[lo]) / (hi - lo))
            return self._at_least_below(b, self.cost[hi] + slope * (b - hi))
        return None

    def _cost_above(self, base_rows: int, extra: int, c_base: float | None = None
                    ) -> float | None:
        """What `base_rows` plain rows and `extra` more cost: `_cost_of`, and from
        _COMPUTE_BOUND_ROWS plain rows up at least the plain step's measured cost grown by
        `_growth` over the rows more. Priced off the plain step itself, a tree pays when its
        expected tokens per row beat what its rows cost as a share of the plain step,
        whatever the machine's speed when the other sizes were measured. `c_base`: the plain
        step's cost, when the caller has it."""
        cost = self._cost_of(base_rows + extra)
        if (cost is None or self.row_share is None or base_rows < _COMPUTE_BOUND_ROWS
                or not extra):
            return cost
        if c_base is None:
            c_base = self._cost_of(base_rows)
        return max(cost, c_base * self._growth(base_rows + extra) / self._growth(base_rows))

    def _growth(self, rows: int) -> float:
        """How many times the step of _COMPUTE_BOUND_ROWS rows a step of `rows` rows costs
        at least: each row r more adds `_min_row_share(r)` of the average row at r, so the
        cost grows by (1 + share(r) / r) a row (a whole row's share: in proportion to the
        rows; 8 rows and 24 more: 2.7x, where a flat share of 8 rows' 0.4 read 2.2x)."""
        g = self._growth_of
        while len(g) <= rows:
            r = len(g) - 1
            g.append(g[-1] * (1 + _min_row_share(r, self.row_share) / r)
                     if r >= _COMPUTE_BOUND_ROWS else 1.0)
        return g[rows]

    def rows_never_pay(self, base_rows: int) -> bool:
        """Whether a row more above a plain step of `base_rows` rows costs at least a whole
        average row (batch 32 and up on CPU: `_ROW_SHARE`), so that no draft, however sure,
        pays for its row: a cheap drafter then does not draft at all (its lookups and the
        trees' pricing were 2-4% of a batch-32 step, every tree turned down), a confident one
        skips its draft steps and holds its requests (`hold`)."""
        return (self.enabled and self.row_share is not None and base_rows >= _COMPUTE_BOUND_ROWS
                and _min_row_share(base_rows, self.row_share) >= 1.0)

    def _at_least_below(self, b: int, value: float) -> float:
        """`value`, raised to the most a measured size up to `b` costs, and from a measured
        size k of at least _COMPUTE_BOUND_ROWS below b, to k's cost grown by `_growth` from k
        to b."""
        if self._floors is None:
            keys = sorted(self.cost)
            self._floors = keys, list(itertools.accumulate((self.cost[k] for k in keys), max))
        keys, floor = self._floors
        i = bisect.bisect_right(keys, b) - 1
        if i < 0:
            return value
        value = max(value, floor[i])
        j = bisect.bisect_left(keys, b) - 1
        if j >= 0 and keys[j] >= _COMPUTE_BOUND_ROWS and self.row_share is not None:
            k = keys[j]
            value = max(value, self.cost[k] * self._growth(b) / self._growth(k))
        return value

    def depth_rates(self, key: tuple[int, bool] | None, depth: int) -> list[float]:
        """For depths 1 .. `depth`: how often a draft there was accepted (its parent
        accepted) in trees of evidence `key`, smoothed (see _PRIOR_RATE); the prior's for a
        key with nothing measured (None: none)."""
        tried = self.depth_tried.get(key, [])
        accepted = self.depth_accepted.get(key, [])
        rates, prior = [], _PRIOR_RATE
        for d in range(depth):
            t, a = (tried[d], accepted[d]) if d < len(tried) else (0.0, 0.0)
            prior = (a + prior * _PRIOR_WEIGHT) / (t + _PRIOR_WEIGHT)
            rates.append(prior)
        return rates

    def copy_node_probs(self, tree: DraftTree, state: SpecState) -> list[float]:
        """A cheap drafter's tree's nodes' chances (`_cheap_node_probs`) for `state`'s
        request, priced by its evidence: to graft it onto a confident drafter's tree."""
        key = None if tree.evidence is None else _evidence_key(tree.evidence, state.copying)
        return self._cheap_node_probs(tree, key)

    def _cheap_node_probs(self, tree: DraftTree, key: tuple[int, bool] | None
                          ) -> list[float]:
        """A cheap drafter's nodes' chances of being accepted: the product of the depth rates
        down to the node, shared by the nodes of one depth (one of them at most is
        accepted), kept non-increasing in the tree's order (its first m nodes are then the
        m most likely: a subtree)."""
        rates = self.depth_rates(key, tree.max_depth)
        path = [1.0]
        for r in rates:
            path.append(path[-1] * r)
        at_depth = [0] * (tree.max_depth + 1)
        for d in tree.depth:
            at_depth[d] += 1
        probs = [1.0]
        for d in tree.depth[1:]:
            probs.append(min(probs[-1], path[d] / at_depth[d]))
        return probs

    def choose_trees(self, base_rows: int, trees: list[DraftTree],
                     states: list[SpecState] | None = None) -> list[int]:
        """How many nodes of each of a cheap drafter's trees (root included; 1: none of its
        drafts) a step of `base_rows` plain rows verifies (`states`: their requests'; new
        ones when None): every node is expected to commit its chance of acceptance, read off
        the depth rates of its tree's evidence (the prior's for one tree of an evidence not
        verified for _STALE_EVIDENCE_STEPS), and the nodes of all trees are taken most likely
        first, as many as give the step the most expected tokens per second (a tree's deep
        drafts are cut where their rows cost more than they are expected to commit)."""
        if not self.enabled:
            return [t.num_nodes for t in trees]
        if self._cost_of(base_rows) is None:
            return [1] * len(trees)  # measure the plain step once, to compare
        explore: set[tuple[int, bool]] = set()  # stale keys explored at this step (one each)
        node_probs = []
        for j, t in enumerate(trees):
            copying = states is not None and states[j].copying
            key = None if t.evidence is None else _evidence_key(t.evidence, copying)
            if (key is not None and key not in explore and key in self.evidence_step
                    and self.step - self.evidence_step[key] > _STALE_EVIDENCE_STEPS):
                explore.add(key)
                self.evidence_step[key] = self.step  # once; its next verify decides
                key = None
            node_probs.append(self._cheap_node_probs(t, key))
        return self._most_tokens_per_second(base_rows, node_probs)[0]

    def _most_tokens_per_second(self, base_rows: int, node_probs: list[list[float]]
                                ) -> tuple[list[int], float]:
        """Nodes per tree (root included) and the expected tokens per second of the choice
        that maximizes it, each node expected to commit its probability (a tree's nodes
        listed most likely first; root first); the rate is 0.0 when nothing is measured
        above the plain step (every node is then tried, and its cost is known next). The
        plain step of `base_rows` must be measured."""
        ranked = sorted(((p, i) for i, probs in enumerate(node_probs) for p in probs[1:]),
                        key=lambda pi: -pi[0])
        c_base = self._cost_of(base_rows)
        best, best_rate, tokens = 0, base_rows / c_base, float(base_rows)
        for m, (p, _) in enumerate(ranked, 1):
            tokens += p
            cost = self._cost_above(base_rows, m, c_base)
            if cost is None:
                best, best_rate = len(ranked), 0.0  # nothing measured from here up: try it
                break
            if tokens / cost > best_rate:
                best, best_rate = m, tokens / cost
        counts = [1] * len(node_probs)
        for _, i in ranked[:best]:
            counts[i] += 1
        return counts, best_rate

    def choose_nodes(self, base_rows: int, trees: list[DraftTree]) -> tuple[list[int], bool]:
        """How many nodes of each of a confident drafter's trees (root included; 1: none of
        its drafts) a step of `base_rows` plain rows verifies, and whether drafting pays.
        Every drafted node is expected to commit its calibrated probability of a token; the
        nodes of all trees are taken most likely first (a tree lists its nodes in that
        order, so its first m nodes are a subtree), as many as give the step the most
        expected tokens per second, its drafting being spent already (row costs are
        recorded without drafting). Drafting pays when that choice, with the drafting a step
        of this batch size spends added, beats the plain step. With nothing measured above
        the plain step, every node is tried (its cost is then known; that step does not
        count as paying)."""
        if not self.enabled:
            return [t.num_nodes for t in trees], True
        c_base = self._cost_of(base_rows)
        if c_base is None:
            return [1] * len(trees), True  # measure the plain step once, to compare
        calib = self.draft_calibration
        # a drafter that gives no probabilities: each node is expected to commit half a token;
        # a grafted tree's nodes come priced (`with_copies`)
        node_probs = [t.expected if t.expected is not None
                      else [calib * p for p in (t.probs or [0.5] * t.num_nodes)] for t in trees]
        counts, best_rate = self._most_tokens_per_second(base_rows, node_probs)
        if best_rate == 0.0:
            return counts, False
        # the step's drafting is spent: the best above is read without it; whether drafting
        # pays is the same with it, against the plain step
        c_best = self._cost_above(base_rows, sum(counts) - len(counts), c_base)
        tokens_best = best_rate * c_best
        return counts, tokens_best / (c_best + self._drafting_of(base_rows)) > base_rows / c_base


def propose_trees(sched: Scheduler, decoders: list[Req]) -> dict[int, DraftTree]:
    """Draft trees for this step's decoders (by id of the Req); {} when speculation is
    off, the pool is short, or the controller expects it not to pay. Every drafter drafts
    first and the controller then keeps what is expected to pay: a cheap drafter's (NGRAM)
    trees cut by the depth rates measured for their evidence (`choose_trees`); a confident
    drafter's (EAGLE) nodes one by one, by the head's calibrated probabilities
    (`choose_nodes`): both keep the most likely nodes, as many as pay their rows."""
    if sched.drafter is None or not decoders:
        return {}
    ctl = sched.spec_controller
    if ctl.plain_step_stale(len(decoders)):
        return {}
    cheap = getattr(sched.drafter, "drafts_cheaply", False)
    if cheap and ctl.rows_never_pay(len(decoders)):
        return {}
    # a confident drafter with a cheap one grafted on (EAGLE's NGRAM branch) drafts its
    # cheap trees for the requests its head is paused for too (the pause is the head's),
    # idling as a cheap drafter does (`_cheap_idles`)
    copies = (not cheap and getattr(sched.drafter, "copier", None) is not None
              and not ctl._cheap_idles(len(decoders)))
    eligible, depths, heads = [], [], set()
    for req in decoders:
        depth = min(req.sampling_params.max_new_tokens - len(req.output_ids),
                    sched.config.context_len - req.seq_len) - 1
        if req.is_decoding and depth >= 1:
            head = ctl.may_draft(req.spec)
            if head or copies:
                eligible.append(req)
                depths.append(depth)
                if head:
                    heads.add(id(req))
    if not eligible:
        return {}
    if cheap:
        if ctl._cheap_idles(len(decoders)):
            return {}
        drafted = sched.drafter.propose(eligible, depths, sched)
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        counts = ctl.choose_trees(len(decoders), [t for _, t in pairs],
                                  [r.spec for r, _ in pairs])
        trees = {id(r): t.first(n) for (r, t), n in zip(pairs, counts, strict=True) if n > 1}
        ctl.cheap_idle_steps = 0 if trees else ctl.cheap_idle_steps + 1
    else:
        if ctl.rows_never_pay(len(decoders)):
            # no tree can pay at this size: no draft steps, and the requests are held (the
            # head stops extending over them) until the batch is asked again
            for req in eligible:
                ctl.hold(req.spec)
            return {}
        # `heads`: which requests' heads draft; the copies are drafted for all of them
        drafted = sched.drafter.propose(eligible, depths, sched,
                                        **({"heads": heads} if copies else {}))
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        if pairs:
            ctl.drafted_step = ctl.step  # this step's drafting is worth measuring
        counts, pays = ctl.choose_nodes(len(decoders), [t for _, t in pairs])
        trees = {}
        kept_copies = False
        for (req, tree), n in zip(pairs, counts, strict=True):
            # its drafting is spent: verify what is worth its rows, but pause a request
            # whose drafting keeps not paying for itself
            if id(req) in heads:
                ctl.record_drafted(req.spec, n > 1 and pays, pays)
            if n > 1:
                trees[id(req)] = tree.first(n)
                kept_copies = kept_copies or any(trees[id(req)].copied or ())
        if copies:
            ctl.cheap_idle_steps = 0 if kept_copies else ctl.cheap_idle_steps + 1
    extra = sum(t.num_nodes - 1 for t in trees.values())
    return trees if len(decoders) + extra <= sched.cache.num_available_slots else {}
