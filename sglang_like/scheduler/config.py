"""SchedulerConfig: the scheduler's knobs. Its own module so that the scheduler's parts
(the output processor) can name it without importing the Scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_like.config import ServerArgs


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's knobs, resolved from ServerArgs and the model."""

    pool_size: int  # KV token slots
    context_len: int
    vocab_size: int
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = 2048
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"
    enable_jump_forward: bool = True
    random_seed: int = 0
    check_accounting: bool = False  # assert the pool invariant after every step (tests)
    speculative_auto_disable: bool = True  # speculate only where measured to pay
    # sample on the logits' device (ServerArgs.device_sampling resolved: layers.device_sampler)
    device_sampling: bool = False
    # distinct LoRA adapters among the running requests; a request on one more waits
    max_loras_per_batch: int = 8
    # priority scheduling (policy.priority_rank): the queue in priority order, preemption of
    # a running request outranked by more than the threshold, and, when max_queued_requests
    # is set, a full queue that drops its least urgent request (None: the queue is bounded
    # before the engine, by the HTTP server's admission)
    enable_priority_scheduling: bool = False
    low_priority_values_first: bool = False
    priority_preemption_threshold: int = 10
    max_queued_requests: int | None = None

    @property
    def prefill_budget(self) -> int:
        if self.chunked_prefill_size and self.chunked_prefill_size > 0:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens

    @property
    def is_chunking(self) -> bool:
        return bool(self.chunked_prefill_size and self.chunked_prefill_size > 0)


def priority_config(sa: ServerArgs) -> dict[str, Any]:
    """SchedulerConfig's priority knobs from the server's (ValueError for bad ones). The queue
    is bounded here only under priority scheduling: only the scheduler knows whom a full
    queue should drop; otherwise the server refuses past --max-queued-requests before."""
    if not isinstance(sa.priority_scheduling_preemption_threshold, int):
        raise ValueError("priority_scheduling_preemption_threshold must be an integer")
    on = bool(sa.enable_priority_scheduling)
    return {
        "enable_priority_scheduling": on,
        "low_priority_values_first": bool(sa.schedule_low_priority_values_first),
        "priority_preemption_threshold": sa.priority_scheduling_preemption_threshold,
        "max_queued_requests": sa.max_queued_requests if on else None,
    }
