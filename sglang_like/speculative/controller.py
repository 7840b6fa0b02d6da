"""When to speculate: a measured cost model, so speculation is never a net slowdown.

A verify pass of N nodes per request costs more than a one-token decode (on CPU the int
kernels' time grows with rows), and a request whose drafts keep failing gains nothing. The
controller keeps what it measured: the step's wall time per number of token rows, and what
drafts committed (NGRAM: per matched length; EAGLE: accepted drafts against the head's own
probabilities of them, which makes those probabilities expected tokens). A step verifies the
drafts that give it the most expected tokens per second, none when plain decoding is faster.
"""

from __future__ import annotations

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
# a cheap drafter's evidence whose trees have not been verified for this many steps is
# expected to do as well as an untried one, once (the text changes: the bench's code-editing
# prompts after chat found their match lengths priced by chat's trees and never drafted)
_STALE_EVIDENCE_STEPS = 256
# the plain step of a batch size is measured again when its last measurement is this many
# steps old: every tree is priced against it, and a drafter that drafts at every step never
# runs one otherwise (measured: the batch-1 plain step kept the 8.7 ms of a step just after
# start while it ran in 5.8, and EAGLE drafted at 0.85x of plain decoding)
_REMEASURE_STEPS = 32
# a row count's cost is the median of its last _COST_SAMPLES steps: an EMA started from the
# first step after start (12 ms where the step runs in 5.8: plans and buffers built) and fed
# a plain step every _REMEASURE_STEPS kept the plain step's price 30-40% high for a hundred
# steps, and EAGLE verified trees that did not pay
_COST_SAMPLES = 5


@dataclass
class SpecState:
    """Per-request speculation state (lives on the Req)."""

    verify_ct: int = 0  # decode forwards of this request (plain or tree): SGLang's spec_verify_ct
    accepted_drafts: int = 0  # drafted tokens the target kept
    backoff_until: int = 0  # the controller's step count before which it does not draft
    num_failed_tries: int = 0  # pauses in a row since a tree was last verified
    empty_steps: int = 0  # steps in a row whose drafts were all turned down (confident drafter)
    ngram: object | None = None  # NgramIndex
    eagle: object | None = None  # EAGLE drafter state: next-step candidates, feature
    eagle_pending: object | None = None  # (first position, target features) not yet drafted


def _ema(old: float | None, value: float, weight: float = _EMA) -> float:
    return value if old is None else (1 - weight) * old + weight * value


def _optimistic(num_nodes: int) -> float:
    """Tokens a tree of `num_nodes` is expected to commit before anything is measured."""
    return 1.0 + 0.5 * (num_nodes - 1)


def _bucket(num_rows: int) -> int:
    return num_rows if num_rows <= 64 else 1 << math.ceil(math.log2(num_rows))


_MAX_EVIDENCE = 8  # match lengths from here on share one expectation


def _evidence_key(evidence: int) -> int:
    """A tree's evidence as the key of its expectation: NGRAM's match length, negative when
    the match was in another request's text; lengths from _MAX_EVIDENCE on share one key."""
    return max(-_MAX_EVIDENCE, min(evidence, _MAX_EVIDENCE))


@dataclass
class SpecController:
    enabled: bool = True  # False: always speculate where a draft exists (tests, benchmarks)
    step: int = 0
    cost: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds (median)
    cost_step: dict[int, int] = field(default_factory=dict)  # rows bucket -> step measured
    _cost_samples: dict[int, deque] = field(default_factory=dict)
    # a cheap drafter's trees by their evidence (NGRAM: matched length) -> tokens committed
    # per verify (EMA over every request's trees)
    accept_by_evidence: dict[int, float] = field(default_factory=dict)
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
    # steps in a row whose cheap trees were all turned down (see _IDLE_STEPS)
    cheap_idle_steps: int = 0
    # evidence key -> the step its trees were last verified (or last explored)
    evidence_step: dict[int, int] = field(default_factory=dict)

    def record_forward(self, num_rows: int, seconds: float) -> None:
        self.step += 1
        b = _bucket(num_rows)
        samples = self._cost_samples.setdefault(b, deque(maxlen=_COST_SAMPLES))
        samples.append(seconds)
        self.cost[b] = statistics.median(samples)
        self.cost_step[b] = self.step

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

    def record_verify(self, state: SpecState, committed: int, tree: DraftTree) -> None:
        """A verify of `tree` committed `committed` tokens (its root's bonus included)."""
        if tree.evidence is not None:
            key = _evidence_key(tree.evidence)
            self.accept_by_evidence[key] = _ema(self.accept_by_evidence.get(key), committed)
            self.evidence_step[key] = self.step
        if tree.probs is not None:
            w = _CALIBRATION_EMA
            self.drafts_accepted = (1 - w) * self.drafts_accepted + w * (committed - 1)
            self.drafts_predicted = (1 - w) * self.drafts_predicted + w * sum(tree.probs[1:])

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
        until = self.step + steps
        state.backoff_until = -(-until // _BACKOFF_STEPS) * _BACKOFF_STEPS

    def may_draft(self, state: SpecState, ahead: int = 0) -> bool:
        """Whether the request may draft `ahead` steps from now."""
        return not self.enabled or self.step + ahead >= state.backoff_until

    def _on_multiple(self, period: int, ahead: int = 0) -> bool:
        """Whether one of this step and the `ahead` after it is a multiple of `period`."""
        return any((self.step + a) % period == 0 for a in range(ahead + 1))

    def worth_it(self, base_rows: int, base_tokens: float, tree_rows: int,
                 tree_tokens: float) -> bool:
        """base: the step without trees (rows run, tokens it commits); tree: with them."""
        if not self.enabled:
            return True
        # the base read off measured sizes too: choose_trees grows it by each tree it keeps
        c_base, c_tree = self._cost_of(base_rows), self._cost_of(tree_rows)
        if c_tree is None:
            return True  # nothing above the base measured yet: try it
        if c_base is None:
            return False  # measure the plain step once, to compare
        return tree_tokens / c_tree > base_tokens / c_base

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
        ms; they cost 33-38)."""
        b = _bucket(rows)
        if b in self.cost:
            return self.cost[b]
        below = [k for k in self.cost if k < b]
        above = [k for k in self.cost if k > b]
        if below and above:
            lo, hi = max(below), min(above)
            return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (b - lo) / (hi - lo)
        if len(below) >= 2 and not above:
            lo, hi = min(below), max(below)
            slope = max(0.0, (self.cost[hi] - self.cost[lo]) / (hi - lo))
            return self.cost[hi] + slope * (b - hi)
        return None

    def choose_trees(self, base_rows: int, trees: list[DraftTree]) -> list[bool]:
        """Which of a cheap drafter's trees to verify in a step of `base_rows` plain rows: by
        the tokens trees with that evidence committed so far (optimistic when none has been
        tried, and for one tree of an evidence not verified for _STALE_EVIDENCE_STEPS), the
        most promising per extra row first, each kept while the step's expected tokens per
        second grow."""
        if not self.enabled:
            return [True] * len(trees)

        explore: set[int] = set()  # stale keys explored at this step (one tree each)
        expected = []
        for t in trees:
            known = None
            if t.evidence is not None:
                key = _evidence_key(t.evidence)
                known = self.accept_by_evidence.get(key)
                if (known is not None and key not in explore and self.step
                        - self.evidence_step.get(key, self.step) > _STALE_EVIDENCE_STEPS):
                    explore.add(key)
                    self.evidence_step[key] = self.step  # once; its next verify decides
                    known = None
            expected.append(known if known is not None else _optimistic(t.num_nodes))

        gains = [(e - 1.0) / (t.num_nodes - 1) for t, e in zip(trees, expected, strict=True)]
        keep = [False] * len(trees)
        rows, tokens = base_rows, float(base_rows)
        for j in sorted(range(len(trees)), key=lambda j: -gains[j]):
            extra_rows, extra_tokens = trees[j].num_nodes - 1, expected[j] - 1.0
            if self.worth_it(rows, tokens, rows + extra_rows, tokens + extra_tokens):
                keep[j] = True
                rows, tokens = rows + extra_rows, tokens + extra_tokens
        return keep

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
        # a drafter that gives no probabilities: each node is expected to commit half a token
        ranked = sorted(((calib * p, i) for i, t in enumerate(trees)
                         for p in (t.probs or [0.5] * t.num_nodes)[1:]), key=lambda pi: -pi[0])
        best, best_rate, tokens = 0, base_rows / c_base, float(base_rows)
        for m, (p, _) in enumerate(ranked, 1):
            tokens += p
            cost = self._cost_of(base_rows + m)
            if cost is None:
                best = len(ranked)  # nothing measured from here up: try it (not "paying")
                best_rate = 0.0
                break
            if tokens / cost > best_rate:
                best, best_rate = m, tokens / cost
        counts = [1] * len(trees)
        for _, i in ranked[:best]:
            counts[i] += 1
        # the step's drafting is spent: the best above is read without it; whether drafting
        # pays is the same with it, against the plain step
        cost_best = base_rows + sum(counts) - len(counts)
        tokens_best = base_rows + sum(p for p, _ in ranked[:best])
        c_best = self._cost_of(cost_best)
        if c_best is None or best_rate == 0.0:
            return counts, False
        return counts, tokens_best / (c_best + self._drafting_of(base_rows)) > base_rows / c_base


def propose_trees(sched: Scheduler, decoders: list[Req]) -> dict[int, DraftTree]:
    """Draft trees for this step's decoders (by id of the Req); {} when speculation is
    off, the pool is short, or the controller expects it not to pay. Every drafter drafts
    first and the controller then keeps what is expected to pay: a cheap drafter's (NGRAM)
    trees whole, by what trees of their evidence committed before (`choose_trees`); a
    confident drafter's (EAGLE) nodes one by one, by the head's calibrated probabilities
    (`choose_nodes`)."""
    if sched.drafter is None or not decoders:
        return {}
    ctl = sched.spec_controller
    if ctl.plain_step_stale(len(decoders)):
        return {}
    cheap = getattr(sched.drafter, "drafts_cheaply", False)
    eligible, depths = [], []
    for req in decoders:
        depth = min(req.sampling_params.max_new_tokens - len(req.output_ids),
                    sched.config.context_len - req.seq_len) - 1
        if req.is_decoding and depth >= 1 and ctl.may_draft(req.spec):
            eligible.append(req)
            depths.append(depth)
    if not eligible:
        return {}
    if cheap:
        if (ctl.enabled and len(decoders) >= _IDLE_MIN_BATCH
                and ctl.cheap_idle_steps >= _IDLE_STEPS and not ctl._on_multiple(_IDLE_PERIOD)):
            return {}
        drafted = sched.drafter.propose(eligible, depths, sched)
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        keep = ctl.choose_trees(len(decoders), [t for _, t in pairs])
        trees = {id(r): t for (r, t), k in zip(pairs, keep, strict=True) if k}
        ctl.cheap_idle_steps = 0 if trees else ctl.cheap_idle_steps + 1
    else:
        drafted = sched.drafter.propose(eligible, depths, sched)
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        if pairs:
            ctl.drafted_step = ctl.step  # this step's drafting is worth measuring
        counts, pays = ctl.choose_nodes(len(decoders), [t for _, t in pairs])
        trees = {}
        for (req, tree), n in zip(pairs, counts, strict=True):
            # its drafting is spent: verify what is worth its rows, but pause a request
            # whose drafting keeps not paying for itself
            ctl.record_drafted(req.spec, n > 1 and pays, pays)
            if n > 1:
                trees[id(req)] = tree.first(n)
    extra = sum(t.num_nodes - 1 for t in trees.values())
    return trees if len(decoders) + extra <= sched.cache.num_available_slots else {}
