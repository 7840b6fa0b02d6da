"""The start-up warmup: a few requests through the real scheduler before the server takes any,
so that the first user request compiles and autotunes nothing (CUDA's Triton kernels, the
caching allocator's first blocks); nothing of them is left behind."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler
from sglang_like.speculative.controller import SpecController

logger = logging.getLogger(__name__)

_PROMPT_LEN = 16
_MAX_STEPS = 64  # far more than the requests below take; a loop past it is a bug


class WarmupResult(NamedTuple):
    """What a warmup ran (the scheduler's own counters forget it)."""

    num_forward_steps: int
    seconds: float


def warm_up(scheduler: Scheduler) -> WarmupResult:
    """Run a greedy and a sampled request through `scheduler.step()`: their prefills in one
    batch, then decode steps of both and of the greedy one alone (the argmax-only path), and
    with a drafter verifies (its prompt repeats itself, so NGRAM finds drafts too). Then the
    radix cache is emptied and the statistics start afresh: every KV slot is free again.
    RuntimeError if a request ends in error (the first user request would fail as well)."""
    t0 = time.perf_counter()
    vocab = scheduler.config.vocab_size
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, seed=0,
                             ignore_eos=True)
    reqs = [Req(f"warmup-{i}", [(17 + 31 * i + 7 * (t % 4)) % vocab for t in range(_PROMPT_LEN)],
                params) for i, params in enumerate((greedy, sampled))]
    # speculate on every step, whatever the controller would have measured: a verify runs
    # (reset_stats below puts the configured controller back)
    scheduler.spec_controller = SpecController(enabled=False)
    try:
        for req in reqs:
            scheduler.add_request(req)
        num_steps = 0
        while scheduler.has_work:
            if num_steps == _MAX_STEPS:
                raise RuntimeError(f"the start-up warmup did not finish in {_MAX_STEPS} steps")
            scheduler.step()
            num_steps += 1
        for req in reqs:
            reason = req.finished_reason
            if reason is None or reason.type == "abort":
                raise RuntimeError(f"the start-up warmup request failed: "
                                   f"{getattr(reason, 'message', None) or 'unfinished'}")
    finally:
        scheduler.abort_all("warmup over")  # none left on a success
        scheduler.take_finished_outside_step()
        scheduler.flush_cache()
        scheduler.reset_stats()
    allocator = scheduler.cache.allocator
    assert allocator.num_free_slots == scheduler.config.pool_size, allocator
    result = WarmupResult(num_steps, time.perf_counter() - t0)
    logger.info("warmed up in %.1f s (%d scheduler steps)", result.seconds, num_steps)
    return result
