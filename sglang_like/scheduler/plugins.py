"""The scheduler's plug-in contracts: drafters (speculative decoding) and prefill/decode
disaggregation.

Each plug-in is a Protocol of the calls the scheduler makes, and is handed a narrow context
(what it may read and the few scheduler operations it may ask for), never the Scheduler:
it cannot reach the queues, the counters or the private steps. Drafters sit below the
scheduler, so their context (`DraftContext`) is defined in `speculative` and re-exported
here; disaggregation sits above it and takes `DisaggContext` from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sglang_like.speculative.context import DraftContext

if TYPE_CHECKING:
    from sglang_like.req import Req
    from sglang_like.schedule_batch import ScheduleBatch
    from sglang_like.scheduler.cache_manager import KVCacheManager
    from sglang_like.speculative.tree import DraftTree

__all__ = ["DisaggContext", "DisaggHooks", "DraftContext", "Drafter"]


class Drafter(Protocol):
    """A speculative drafter (NGRAM, EAGLE, a test's scripted one) as the scheduler drives it.

    Required: `propose`. Optional, looked up by name (a drafter without them is driven the
    same, less those calls):

    - `drafts_cheaply: bool` - drafting costs next to nothing (NGRAM): the controller judges
      the drafted trees, not whether to draft;
    - `copier` - a cheap drafter grafted onto a confident one (EAGLE's NGRAM branch): when
      not None, `propose` also takes `heads=` (ids of the requests whose head drafts);
    - `after_forward(batch, committed, ctx)` - after each forward; `committed` maps the id of
      each verified Req to the tree nodes its verify committed, in order (root first);
    - `finished(req)` - a request ended (NGRAM keeps its text); `flush()` - the radix cache
      was emptied.

    A drafter writes only its own per-request state (`req.spec.ngram` / `eagle` /
    `eagle_pending`); see `DraftContext` for what else it may touch.
    """

    def propose(self, reqs: list[Req], max_depths: list[int], ctx: DraftContext
                ) -> list[DraftTree | None]:
        """A tree per request (None: no draft), at most `max_depths[i]` deep."""
        ...


@dataclass(frozen=True)
class DisaggContext:
    """The scheduler as prefill/decode disaggregation sees it during one call.

    Who may mutate what: the PD manager owns its in-flight requests (those not in the
    scheduler's queues) and their slots: it may lock a prefix, allocate, write rows, free and
    release through `cache` for them, and for nothing else. Requests enter the scheduler only
    through `enqueue` / `join_running`; scheduler counters move only through
    `record_admission` / `join_running`. `running` is read-only.
    """

    cache: KVCacheManager
    running: Sequence[Req]  # the running batch, to size admission by (read-only)
    max_running_requests: int
    # a prefill worker's request whose room is registered joins the waiting queue
    enqueue: Callable[[Req], None]
    # end a request in the scheduler's queues (Scheduler.abort): True if it was there
    abort: Callable[[str], bool]
    # a request given its row and slots here: counted as scheduled (its prompt, its hit)
    record_admission: Callable[[Req], None]
    # a request whose prompt KV arrived (decode worker): it joins the running batch with the
    # first token (token, logprob, top logprobs) and is reported in `touched` (or ends there)
    join_running: Callable[[Req, int, float | None, Any, list[Req]], None]


class DisaggHooks(Protocol):
    """A prefill or decode worker's PD manager (`Scheduler.disagg`), as the scheduler calls it
    on the loop thread. Requests it reports ended it has already finished (`req.finish`)."""

    mode: str  # "prefill" | "decode"

    @property
    def has_news(self) -> bool:
        """Something for the next `poll` (the loop steps while True)."""
        ...

    @property
    def num_inflight(self) -> int:
        """Requests it holds outside the scheduler's queues."""
        ...

    def add(self, req: Req) -> None:
        """Take a PD request (it carries a bootstrap room); it may finish it at once."""
        ...

    def poll(self, ctx: DisaggContext, touched: list[Req]) -> None:
        """At the start of a step: admit, transfer, time out; append to `touched` the requests
        that ended or have output."""
        ...

    def abort(self, rid: str, ctx: DisaggContext) -> Req | None:
        """End `rid` if it is in flight here (None: not here)."""
        ...

    def abort_all(self, message: str, ctx: DisaggContext) -> list[Req]:
        """End every request in flight here; returns them."""
        ...

    def before_forward(self, batch: ScheduleBatch) -> Callable[[int], None] | None:
        """The forward's per-layer hook (a prefill worker streams KV out), or None."""
        ...

    def after_forward(self) -> None:
        """The forward ended (or raised): wait for what its hook started."""
        ...

    def after_process(self, batch: ScheduleBatch) -> None:
        """The batch's tokens are taken (a prefill worker sends its first tokens)."""
        ...

    def report_ended(self) -> None:
        """Tell the other side about requests that ended (also right after a failed step)."""
        ...

    def held_slots(self) -> list[int]:
        """Allocated slots that no request row accounts for (transfers, quarantine)."""
        ...

    def held_reqs(self) -> list[Req]:
        """Requests holding a row outside the running batch."""
        ...

    def info(self) -> dict[str, Any]:
        """Its state for get_server_info."""
        ...

    def close(self) -> None:
        """Stop its channel."""
        ...
