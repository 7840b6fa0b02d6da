"""Priority scheduling: the queue in priority order (FCFS within one), preemption of a running
request a waiting one outranks, and a full queue that drops its lowest priority. First the
scheduler with a scripted runner (exact steps), then the real engine in process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sglang_like.model_loader import load_tokenizer
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig

from .fake_runner import VOCAB, FakeRunner, expected_continuation

EOS = frozenset({0, 2})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make(tokenizer, pool_size=512, max_running=1, low_first=False, threshold=10,
         max_queued=None, policy="lpm") -> Scheduler:
    runner = FakeRunner(pool_size, max_running + 1, 1024)
    config = SchedulerConfig(
        pool_size=pool_size, context_len=1024, vocab_size=VOCAB,
        max_running_requests=max_running, schedule_policy=policy, check_accounting=True,
        enable_priority_scheduling=True, low_priority_values_first=low_first,
        priority_preemption_threshold=threshold, max_queued_requests=max_queued,
    )
    return Scheduler(config, runner, tokenizer, EOS)


def req(rid: str, priority: int, max_new: int, start: int, prompt_len: int = 10) -> Req:
    r = Req(rid, list(range(start, start + prompt_len)),
            SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    r.priority = priority
    return r


def finish_order(sched: Scheduler, on_step: Callable[[int], None] | None = None
                 ) -> list[Req]:
    """Step until the scheduler drains; the requests in the order they ended."""
    done: list[Req] = []
    for step in range(5000):
        if not sched.has_work:
            break
        if on_step is not None:
            on_step(step)
        done += [r for r in sched.step() if r.is_finished]
    assert not sched.has_work
    return done


# ---- the scheduler, scripted ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
@pytest.mark.parametrize("low_first", [False, True])
def test_a_full_queue_runs_by_priority_then_arrival(tokenizer, low_first, policy) -> None:
    """One running row: the queue behind the first request ends in priority order (a higher
    value first by default, a lower one with low_priority_values_first), arrival order
    within a priority; equal-sized prompts, so no prefix reorders them."""
    sched = make(tokenizer, low_first=low_first, policy=policy)
    sched.add_request(req("first", 0, 4, 300))
    sched.step()  # it holds the one row from here
    for i, (rid, priority) in enumerate([("a0", 0), ("b5", 5), ("c1", 1), ("d5", 5),
                                         ("e-3", -3), ("f1", 1)]):
        sched.add_request(req(rid, priority, 2, 400 + 20 * i))
    order = [r.rid for r in finish_order(sched)]
    by_value = ["b5", "d5", "c1", "f1", "a0", "e-3"]
    low_values = ["e-3", "a0", "c1", "f1", "b5", "d5"]
    assert order == ["first", *(low_values if low_first else by_value)]


@pytest.mark.parametrize("priority, preempts", [(11, True), (10, False)])
def test_a_waiting_request_preempts_only_past_the_threshold(tokenizer, priority,
                                                            preempts) -> None:
    """With no row free, a waiting request outranking the running one by more than the
    threshold (10) takes its row; the preempted one resumes from its cached prefix and its
    output is what it would have been. At exactly the threshold it waits (SGLang's rule)."""
    sched = make(tokenizer)
    low = req("low", 0, 30, 300)
    sched.add_request(low)
    high = req("high", priority, 3, 500)

    def arrive(step: int) -> None:
        if step == 5:
            sched.add_request(high)

    order = [r.rid for r in finish_order(sched, arrive)]
    assert order == (["high", "low"] if preempts else ["low", "high"])
    assert low.num_retractions == int(preempts)
    assert low.output_ids == expected_continuation(low.origin_input_ids, 30)
    assert high.output_ids == expected_continuation(high.origin_input_ids, 3)
    # each prompt ran once: the preempted request came back with its prompt (and output so
    # far) from the radix tree
    assert sched.num_computed_prompt_tokens == low.prompt_len + high.prompt_len


def test_preemption_frees_kv_slots_least_urgent_then_latest_first(tokenizer) -> None:
    """Rows are free but KV slots are not: the waiting urgent request retracts running ones
    it outranks, the lowest priority first (the latest of equals), only as many as it needs,
    and never one within the threshold."""
    sched = make(tokenizer, pool_size=160, max_running=4)
    running = [req("p0-early", 0, 40, 300, 30), req("p0-late", 0, 40, 400, 30),
               req("p15", 15, 40, 500, 30)]
    for r in running:
        sched.add_request(r)
    for _ in range(3):
        sched.step()
    assert len(sched.running) == 3
    urgent = req("urgent", 20, 4, 700, 40)
    sched.add_request(urgent)
    sched.step()
    retracted = {r.rid for r in running if r.num_retractions}
    assert retracted == {"p0-late"}  # the latest of the least urgent was enough
    assert urgent in sched.running
    finish_order(sched)
    for r in [*running, urgent]:
        assert r.output_ids == expected_continuation(r.origin_input_ids,
                                                     r.sampling_params.max_new_tokens)


@pytest.mark.parametrize("low_first", [False, True])
def test_a_full_queue_drops_its_lowest_priority(tokenizer, low_first) -> None:
    """max_queued_requests 2: a newcomer below everything queued is refused (429); one above
    drops the lowest queued request (the latest of equals) in its place."""
    sched = make(tokenizer, max_queued=2, low_first=low_first)
    sign = -1 if low_first else 1
    sched.add_request(req("running", 0, 3, 300))
    sched.step()
    for rid, p in [("q1", 1), ("q1-later", 1)]:
        sched.add_request(req(rid, sign * p, 2, 400 + 20 * len(sched.waiting)))
    sched.add_request(req("lowest", sign * 0, 2, 500))
    sched.add_request(req("highest", sign * 9, 2, 600))
    ended = {r.rid: r.finished_reason for r in sched.take_finished_outside_step()}
    assert set(ended) == {"lowest", "q1-later"}
    for reason in ended.values():
        assert reason.type == "abort" and reason.status_code == 429
    assert "is the lowest" in ended["lowest"].message
    assert "dropped" in ended["q1-later"].message
    assert [r.rid for r in finish_order(sched)] == ["running", "highest", "q1"]


# ---- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_engine):
    """One running row, exact fp32 (outputs equal token for token however they were
    scheduled), priorities on."""
    return make_engine(quantization="none", max_running_requests=1, max_total_tokens=2048,
                       enable_priority_scheduling=True)


class StepWatch:
    """Wraps the engine's scheduler step: records the order requests end in, and can hold
    the loop inside a step (once `hold_when` says so) until `release`, so that requests
    submitted meanwhile reach the scheduler together."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.step = scheduler.step
        self.ended: list[Req] = []
        self.hold_when: Callable[[], bool] | None = None
        self.holding = threading.Event()
        self._release = threading.Event()

    def __call__(self) -> list[Req]:
        if self.hold_when is not None and self.hold_when():
            self.hold_when = None
            self.holding.set()
            assert self._release.wait(60), "the test never released the loop"
        out = self.step()
        self.ended += [r for r in out if r.is_finished]
        return out

    def release(self) -> None:
        self._release.set()


@contextlib.contextmanager
def watched(engine: Any) -> Iterator[StepWatch]:
    watch = StepWatch(engine.scheduler)
    engine.scheduler.step = watch
    try:
        yield watch
    finally:
        watch.release()
        engine.scheduler.step = watch.step


def ids(engine: Any, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_engine_orders_a_full_queue_by_priority(engine) -> None:
    """Six requests queue behind one running request (one row): they end by priority, in
    arrival order within one."""
    prompts = {name: ids(engine, f"Item {name}: the number {k} is") for k, name in
               enumerate(["first", "a0", "b5", "c1", "d5", "e-3"])}
    priorities = {"first": 0, "a0": 0, "b5": 5, "c1": 1, "d5": 5, "e-3": -3}

    async def scenario(watch: StepWatch) -> None:
        def submit(name: str, n: int) -> asyncio.Task:
            # token ids: submitted in order, before the task's first await
            return asyncio.ensure_future(engine.async_generate(
                input_ids=prompts[name], sampling_params={**GREEDY, "max_new_tokens": n},
                rid=name, priority=priorities[name]))

        watch.hold_when = lambda: True
        first = submit("first", 3)
        assert await asyncio.to_thread(watch.holding.wait, 60)
        rest = [submit(name, 1) for name in ["a0", "b5", "c1", "d5", "e-3"]]
        await asyncio.sleep(0)  # each task submits before its first await
        assert engine.num_queued_requests == 6  # "first" waiting, five in the held inbox
        watch.release()
        await asyncio.gather(first, *rest)

    with watched(engine) as watch:
        asyncio.run(scenario(watch))
    assert [r.rid for r in watch.ended] == ["first", "b5", "d5", "c1", "a0", "e-3"]


def test_engine_preempts_for_an_urgent_request_and_keeps_the_output(engine) -> None:
    """A request 100 above the running one, arriving mid-decode, takes the one row at once;
    the preempted request resumes from the radix tree and its greedy output is unchanged."""
    low_ids, high_ids = ids(engine, "A long story about a lighthouse:"), ids(engine, "2+2=")
    alone = engine.generate(input_ids=low_ids, sampling_params={**GREEDY, "max_new_tokens": 12})
    high_alone = engine.generate(input_ids=high_ids,
                                 sampling_params={**GREEDY, "max_new_tokens": 2})

    async def scenario(watch: StepWatch) -> list[dict]:
        def submit(name: str, prompt: list[int], n: int, priority: int) -> asyncio.Task:
            return asyncio.ensure_future(engine.async_generate(
                input_ids=prompt, rid=name, priority=priority,
                sampling_params={**GREEDY, "max_new_tokens": n}))

        sched = engine.scheduler
        watch.hold_when = lambda: any(r.rid == "low" and len(r.output_ids) >= 4
                                      for r in sched.running)
        low = submit("low", low_ids, 12, 0)
        assert await asyncio.to_thread(watch.holding.wait, 60)
        high = submit("high", high_ids, 2, 100)
        await asyncio.sleep(0)  # submitted: in the held loop's inbox
        assert engine.num_queued_requests == 1
        watch.release()
        return await asyncio.gather(low, high)

    with watched(engine) as watch:
        low, high = asyncio.run(scenario(watch))
    assert [r.rid for r in watch.ended] == ["high", "low"]
    assert watch.ended[1].num_retractions == 1
    assert low["output_ids"] == alone["output_ids"]
    assert high["output_ids"] == high_alone["output_ids"]


def test_engine_priority_values_checked(engine) -> None:
    for bad in ("high", 1.5, True, 1 << 63):
        with pytest.raises(ValueError, match="priority"):
            engine.generate("Hi", {"max_new_tokens": 1}, priority=bad)
