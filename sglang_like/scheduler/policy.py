"""Which waiting requests to prefill next: ordering (priority, then longest prefix match or
FCFS)."""

from __future__ import annotations

from collections.abc import Callable

from sglang_like.req import Req

# Above this many waiting requests, prefix matching every one of them each step costs more
# than the reuse it finds; fall back to arrival order (SGLang does the same).
_LPM_MAX_QUEUE = 128
# A request that shares this many more tokens with one already picked in this step than it
# finds in the tree waits one step: the picked one's prefix will be in the tree by then.
IN_BATCH_SHARE_THRESHOLD = 32


def priority_rank(req: Req, low_values_first: bool) -> int:
    """Where a request's priority puts it under priority scheduling: a smaller rank runs
    first. SGLang's default is that a higher priority value runs first; with
    `low_values_first` (SGLang's --schedule-low-priority-values-first) a lower one does, as
    in vLLM."""
    return req.priority if low_values_first else -req.priority


def order_waiting(
    waiting: list[Req], policy: str, prefix_len_of: Callable[[Req], int],
    rank_of: Callable[[Req], int] | None = None,
) -> list[Req]:
    """Return `waiting` in the order to try them: by `rank_of` first (priority scheduling;
    None: all equal), then retracted requests, then the policy's order (the longest cached
    prefix for lpm), then arrival."""
    def rank(r: Req) -> int:
        return 0 if rank_of is None else rank_of(r)

    if policy == "lpm" and len(waiting) <= _LPM_MAX_QUEUE:
        keyed = [(rank(r), -r.num_retractions, -prefix_len_of(r), r.arrival_time, i)
                 for i, r in enumerate(waiting)]
    else:
        keyed = [(rank(r), -r.num_retractions, 0, r.arrival_time, i)
                 for i, r in enumerate(waiting)]
    keyed.sort()
    return [waiting[k[-1]] for k in keyed]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (slice compares, not a Python loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
