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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_like.req import SpecState
from sglang_like.speculative.step_costs import StepCosts

if TYPE_CHECKING:
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


def _backoff_end(step: int) -> int:
    """`step` rounded up to a multiple of _BACKOFF_STEPS: pauses end together."""
    return -(-step // _BACKOFF_STEPS) * _BACKOFF_STEPS


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
class SpecController(StepCosts):
    """What drafts commit, as measured (per evidence, per calibration), which requests draft
    (pauses), and which nodes a step verifies: those that pay at the prices of `StepCosts`."""

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

    def cheap_idles(self, batch_size: int) -> bool:
        """Whether a cheap drafter skips this step: in a batch of at least _IDLE_MIN_BATCH
        whose cheap trees were all turned down _IDLE_STEPS steps in a row, it drafts only
        every _IDLE_PERIOD-th step."""
        return (self.enabled and batch_size >= _IDLE_MIN_BATCH
                and self.cheap_idle_steps >= _IDLE_STEPS and not self._on_multiple(_IDLE_PERIOD))

    def _on_multiple(self, period: int, ahead: int = 0) -> bool:
        """Whether one of this step and the `ahead` after it is a multiple of `period`."""
        return any((self.step + a) % period == 0 for a in range(ahead + 1))

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


