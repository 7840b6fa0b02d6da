"""Which waiting requests to prefill next: ordering (longest prefix match or FCFS)."""

from __future__ import annotations

from collections.abc import Callable

from sglang_like.req import Req

# Above this many waiting requests, prefix matching every one of them each step costs more
# than the reuse it finds; fall back to arrival order (SGLang does the same).
_LPM_MAX_QUEUE = 128
# A request that shares this many more tokens with one already picked in this step than it
# finds in the tree waits one step: the picked one's prefix will be in the tree by then.
IN_BATCH_SHARE_THRESHOLD = 32


def order_waiting(
    waiting: list[Req], policy: str, prefix_len_of: Callable[[Req], int]
) -> list[Req]:
    """Return `waiting` in the order to try them. Retracted requests always go first."""
    if policy == "lpm" and len(waiting) <= _LPM_MAX_QUEUE:
        keyed = [(-r.num_retractions, -prefix_len_of(r), r.arrival_time, i) for i, r in
                 enumerate(waiting)]
    else:
        keyed = [(-r.num_retractions, 0, r.arrival_time, i) for i, r in enumerate(waiting)]
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
