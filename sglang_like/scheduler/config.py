"""SchedulerConfig: the scheduler's knobs. Its own module so that the scheduler's parts
(the output processor) can name it without importing the Scheduler."""

from __future__ import annotations

from dataclasses import dataclass


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
    # distinct LoRA adapters among the running requests; a request on one more waits
    max_loras_per_batch: int = 8

    @property
    def prefill_budget(self) -> int:
        if self.chunked_prefill_size and self.chunked_prefill_size > 0:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens

    @property
    def is_chunking(self) -> bool:
        return bool(self.chunked_prefill_size and self.chunked_prefill_size > 0)
