"""What a step costs by its number of token rows, as measured: the speculation controller's
price list (`SpecController` builds on it).

Every step records its wall time (less its drafting, which is priced apart per batch size)
under its row count; a count not run yet is read off the measured ones around it, never
below what fewer rows were measured to cost, and from _COMPUTE_BOUND_ROWS rows up at least
the plain step grown row by row (_ROW_SHARE).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

_EMA = 0.3  # weight of a step's drafting time in its batch size's average
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
# them; `StepCosts._growth`): what a row more cost against an average row. Measured two
# ways on a 2-core AMD EPYC, int4: a verify's tree rows over a batch of 8 (NGRAM always on,
# the bench's code prompts, step times by row count in one run): 0.75-0.8 from 8 rows to
# 14-30, about 0.86 from 20 to 30; and more requests' decode rows with the steps of each pair
# back to back (benchmarks/bench_row_cost.py, 5 rounds, medians): 0.39 from 8 rows to 12 (spread
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


def _bucket(num_rows: int) -> int:
    return num_rows if num_rows <= 64 else 1 << math.ceil(math.log2(num_rows))


def _ema(old: float | None, value: float, weight: float = _EMA) -> float:
    return value if old is None else (1 - weight) * old + weight * value


@dataclass
class StepCosts:
    """A step's cost per number of rows and its drafting's per batch size, as measured, and
    the prices read off them (`_cost_of`, `_cost_above`)."""

    enabled: bool = True  # False: always speculate where a draft exists (tests, benchmarks)
    # the least share of an average row a row more costs above a compute-bound plain step
    # (see _ROW_SHARE, measured on CPU); None: no such floor (CUDA, where rows are cheap)
    row_share: tuple[tuple[int, float], ...] | None = _ROW_SHARE
    step: int = 0
    cost: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds (median)
    cost_step: dict[int, int] = field(default_factory=dict)  # rows bucket -> step measured
    _cost_samples: dict[int, deque] = field(default_factory=dict)
    # batch-size bucket -> seconds a step spent drafting (EAGLE: the head's extend after the
    # forward and its draft steps; EMA): sunk in every step's measured cost, it is what a
    # step without speculation would not pay
    drafting: dict[int, float] = field(default_factory=dict)
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
