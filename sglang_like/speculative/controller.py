"""When to speculate: a measured cost model, so speculation is never a net slowdown.

A verify pass of N nodes per request costs more than a one-token decode (on CPU the int
kernels' time grows with rows), and a request whose drafts keep failing gains nothing. The
controller keeps what it measured: the forward's wall time per number of token rows, and per
request the tokens each verify committed (an exponential moving average). A step speculates
when the expected tokens per second with the trees beat those without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_like.req import Req
    from sglang_like.scheduler import Scheduler
    from sglang_like.speculative.tree import DraftTree

# A request whose verifies commit fewer than this many tokens on average stops drafting for
# a while, then tries again (text changes: a copy-heavy stretch may follow a free one).
# Each failure in a row doubles the pause (up to _MAX_BACKOFF_DOUBLINGS times), and pauses
# end on multiples of _BACKOFF_STEPS, so the requests of a batch retry together: one step
# whose batch carries every retrying tree, not a tree in nearly every step (one request's
# tree moves the whole batch onto the verify path: measured at batch 8, rows 8 -> 13 cost
# 19.6 -> 25.9 ms, and staggered retries put a tree in 29 of 96 steps for 1.01 tokens per
# verify: 0.85x of speculation off).
_MIN_USEFUL_ACCEPT = 1.3
_BACKOFF_STEPS = 32
_MAX_BACKOFF_DOUBLINGS = 4
_EMA = 0.3
# A request with no acceptance of its own is expected to do what the others did (a slow
# average over every request's verifies), except on every _EXPLORE_STEPS-th step, where it
# is expected to do well and tries: the average is refreshed, and a workload that changes
# (a copy-heavy stretch after open chat) is noticed.
_POPULATION_EMA = 0.1
_EXPLORE_STEPS = 256
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


@dataclass
class SpecState:
    """Per-request speculation state (lives on the Req)."""

    verify_ct: int = 0  # decode forwards of this request (plain or tree): SGLang's spec_verify_ct
    accepted_drafts: int = 0  # drafted tokens the target kept
    accept_ema: float | None = None  # tokens committed per tree verify
    backoff_until: int = 0  # the controller's step count before which it does not draft
    num_failed_tries: int = 0  # back-offs in a row since a verify last paid
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
    cost: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds (EMA)
    # a cheap drafter's trees by their evidence (NGRAM: matched length) -> tokens committed
    # per verify (EMA over every request's trees)
    accept_by_evidence: dict[int, float] = field(default_factory=dict)
    # a model drafter's tokens committed per verify over every request (EMA)
    population_accept: float | None = None
    # steps in a row whose cheap trees were all turned down (see _IDLE_STEPS)
    cheap_idle_steps: int = 0
    # evidence key -> the step its trees were last verified (or last explored)
    evidence_step: dict[int, int] = field(default_factory=dict)

    def record_forward(self, num_rows: int, seconds: float) -> None:
        self.step += 1
        b = _bucket(num_rows)
        self.cost[b] = _ema(self.cost.get(b), seconds)

    def record_verify(self, state: SpecState, committed: int, evidence: int | None = None,
                      drafts_cheaply: bool = False) -> None:
        state.accept_ema = _ema(state.accept_ema, committed)
        if evidence is not None:
            key = _evidence_key(evidence)
            self.accept_by_evidence[key] = _ema(self.accept_by_evidence.get(key), committed)
            self.evidence_step[key] = self.step
        if not self.enabled or drafts_cheaply:
            return  # a cheap drafter's trees are judged one by one (`choose_trees`)
        self.population_accept = _ema(self.population_accept, committed, _POPULATION_EMA)
        if state.accept_ema < _MIN_USEFUL_ACCEPT:
            self._pause(state)
            state.accept_ema = None  # the next try starts afresh
        else:
            state.num_failed_tries = 0

    def back_off(self, reqs: list[Req]) -> None:
        """These requests pause drafting (as after a verify that did not pay)."""
        if self.enabled:
            for req in reqs:
                self._pause(req.spec)

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

    def may_try(self, state: SpecState, batch_size: int, ahead: int = 0) -> bool:
        """Whether the request may draft in a step of `batch_size` decoders: one that has
        measured its acceptance any step; one that has not (new, or back from a pause) alone
        in its batch, or in a batch on a multiple of _BACKOFF_STEPS steps, where every such
        request tries together (a tree per step, each from another request, would keep the
        whole batch on the verify path for the price of guesses); and when every request's
        trees have not paid, only on an exploring step (so an EAGLE head does not extend
        over requests it will not draft for). `ahead`: true if it may in any of the next
        `ahead` + 1 steps."""
        if not self.may_draft(state, ahead):
            return False
        if not self.enabled or state.accept_ema is not None:
            return True
        if (self.population_accept is not None and self.population_accept < _MIN_USEFUL_ACCEPT
                and not self._on_multiple(_EXPLORE_STEPS, ahead)):
            return False  # the others' trees did not pay: wait for an exploring step
        return batch_size == 1 or self._on_multiple(_BACKOFF_STEPS, ahead)

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

    def expected_tokens(self, state: SpecState, num_nodes: int) -> float:
        """Tokens a verify of this request is expected to commit: its own average; without
        one, every request's (optimistic when nothing is measured, and on exploring steps)."""
        if state.accept_ema is not None:
            return state.accept_ema
        if self.population_accept is None or self._on_multiple(_EXPLORE_STEPS):
            return _optimistic(num_nodes)
        return self.population_accept


def propose_trees(sched: Scheduler, decoders: list[Req]) -> dict[int, DraftTree]:
    """Draft trees for this step's decoders (by id of the Req); {} when speculation is
    off, the pool is short, or the controller expects it not to pay."""
    if sched.drafter is None or not decoders:
        return {}
    ctl = sched.spec_controller
    cheap = getattr(sched.drafter, "drafts_cheaply", False)
    eligible, depths = [], []
    for req in decoders:
        depth = min(req.sampling_params.max_new_tokens - len(req.output_ids),
                    sched.config.context_len - req.seq_len) - 1
        # a cheap drafter's trees are judged one by one after drafting (`choose_trees`), on
        # what trees with that evidence committed: no per-request pauses or guesses
        allowed = ctl.may_draft(req.spec) if cheap else ctl.may_try(req.spec, len(decoders))
        if req.is_decoding and depth >= 1 and allowed:
            eligible.append(req)
            depths.append(depth)
    if not eligible:
        return {}
    if cheap:  # draft first, then keep the trees that are expected to pay
        if (ctl.enabled and len(decoders) >= _IDLE_MIN_BATCH
                and ctl.cheap_idle_steps >= _IDLE_STEPS and not ctl._on_multiple(_IDLE_PERIOD)):
            return {}
        drafted = sched.drafter.propose(eligible, depths, sched)
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        keep = ctl.choose_trees(len(decoders), [t for _, t in pairs])
        trees = {id(r): t for (r, t), k in zip(pairs, keep, strict=True) if k}
        ctl.cheap_idle_steps = 0 if trees else ctl.cheap_idle_steps + 1
    else:
        # judge with the trees' full size before drafting: an EAGLE draft costs head forwards
        nodes = sched.drafter.num_draft_tokens
        base = len(decoders)
        expected = sum(ctl.expected_tokens(r.spec, nodes) for r in eligible)
        if not ctl.worth_it(base, base, base + len(eligible) * (nodes - 1),
                            base - len(eligible) + expected):
            # not paying at this step's cost: these requests back off as a failed verify
            # would, so an EAGLE head stops extending over them every step (its features
            # wait, and it catches up when they may draft again); measured before this, a
            # head that ran each step with nothing drafted made EAGLE3 0.54-0.59x of
            # speculation off at batch 1
            ctl.back_off(eligible)
            return {}
        proposed = sched.drafter.propose(eligible, depths, sched)
        trees = {id(r): t for r, t in zip(eligible, proposed, strict=True) if t is not None}
    extra = sum(t.num_nodes - 1 for t in trees.values())
    return trees if len(decoders) + extra <= sched.cache.num_available_slots else {}
