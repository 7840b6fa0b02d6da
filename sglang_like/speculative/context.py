"""DraftContext: what a drafter may use of the scheduler, handed to it for each call.

It lives here, below the scheduler, so that drafters can name it without importing the
scheduler (which imports them); the scheduler builds a fresh one for every `propose` and
`after_forward` call, and the drafter must not keep it (`num_requests` is a snapshot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_like.speculative.controller import SpecController


@dataclass(frozen=True)
class DraftContext:
    """The scheduler as a drafter sees it during one call.

    Who may mutate what: the drafter may write the per-request state it owns (`req.spec`'s
    `ngram` / `eagle` / `eagle_pending`) and ask the controller to hold or price requests
    (`hold`, `may_draft`, `copy_node_probs`, `min_draft_logprob`, `draft_calibration`); the
    controller's measurements and every scheduler counter are the scheduler's. A drafter
    never ends, queues or retracts a request.
    """

    # the scheduler's speculation controller (which requests draft, what a draft is worth)
    controller: SpecController
    # scratch KV slots for draft steps (None: the pool is short, even after eviction); every
    # slot taken must be handed back to `free_slots` before the call returns
    alloc_slots: Callable[[int], list[int] | None]
    free_slots: Callable[[list[int]], None]
    # requests in the scheduler (running and waiting) when the call was made
    num_requests: int
