"""The fault storm through the Engine (issue 11, check 1): 2,000 requests of mixed kinds on the
default model with faults injected in forwards, sampling and grammars. Every caller gets an
answer within a deadline, every fault reaches a caller as an abort message, no KV slot
leaks, and the engine goes on serving."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import pytest

from sglang_like.utils.fault_injection import ENV_VAR

pytestmark = pytest.mark.slow

NUM_REQUESTS = 2000
CONCURRENCY = 96
DEADLINE_S = 180.0
FAULTS = "forward=0.05,sample=0.02,grammar=0.05,seed=1"
CONTEXT = 512
KINDS = ("plain", "stream", "n2", "regex", "json", "abort", "oversized")
SCHEMA = ('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
          '"required": ["ok"]}')


def _messages(out: Any) -> list[str]:
    outs = out if isinstance(out, list) else [out]
    return [(o["meta_info"]["finish_reason"] or {}).get("message") or "" for o in outs]


async def _one(engine: Any, i: int, kind: str, rng: random.Random) -> tuple[str, list[str]]:
    # a few dozen distinct prompts: after the first of each, the radix cache serves the
    # prompt (prefill on 2 CPU cores runs at a few hundred tokens/s; the storm is about
    # faults, not prefill)
    prompt = f"Tell me one fact about the number {rng.randint(0, 40)}."
    greedy = {"temperature": 0, "max_new_tokens": rng.randint(1, 6)}
    if kind == "plain":
        return kind, _messages(await engine.async_generate(prompt, greedy))
    if kind == "stream":
        last = None
        async for chunk in await engine.async_generate(prompt, greedy, stream=True):
            last = chunk
        return kind, _messages(last)
    if kind == "n2":
        params = {"temperature": 0.8, "max_new_tokens": 4, "n": 2}
        return kind, _messages(await engine.async_generate(prompt, params))
    if kind == "regex":
        params = {**greedy, "max_new_tokens": 8, "regex": "(yes|no|maybe), because"}
        return kind, _messages(await engine.async_generate(prompt, params))
    if kind == "json":
        params = {**greedy, "max_new_tokens": 12, "json_schema": SCHEMA}
        return kind, _messages(await engine.async_generate(prompt, params))
    if kind == "abort":
        rid = f"storm-abort-{i}"
        task = asyncio.ensure_future(engine.async_generate(
            prompt, {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}, rid=rid))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        engine.abort(rid)
        return kind, _messages(await task)
    try:  # oversized: refused at the door with a message
        await engine.async_generate("word " * (CONTEXT + 10), greedy)
    except ValueError as e:
        return kind, [f"rejected: {e}"]
    raise AssertionError("an oversized prompt was accepted")


async def _storm(engine: Any) -> tuple[Counter, list[str], int]:
    rng = random.Random(0)
    sem = asyncio.Semaphore(CONCURRENCY)
    kinds = [rng.choice(KINDS) for _ in range(NUM_REQUESTS)]
    unanswered = 0

    async def guarded(i: int) -> tuple[str, list[str]] | None:
        nonlocal unanswered
        async with sem:
            try:
                return await asyncio.wait_for(_one(engine, i, kinds[i], random.Random(i)),
                                              DEADLINE_S)
            except asyncio.TimeoutError:
                unanswered += 1
                return None

    results = await asyncio.gather(*(guarded(i) for i in range(NUM_REQUESTS)))
    by_kind: Counter = Counter()
    messages: list[str] = []
    for r in results:
        if r is not None:
            by_kind[r[0]] += 1
            messages += r[1]
    return by_kind, messages, unanswered


def test_storm_through_the_engine(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, FAULTS)
    engine = make_engine(max_total_tokens=6144, context_length=CONTEXT,
                         max_running_requests=64)
    try:
        t0 = time.monotonic()
        by_kind, messages, unanswered = asyncio.run(_storm(engine))
        elapsed = time.monotonic() - t0
        assert unanswered == 0, f"{unanswered} callers got no answer within {DEADLINE_S} s"
        assert sum(by_kind.values()) == NUM_REQUESTS and set(by_kind) == set(KINDS)
        faults = engine.get_server_info()["injected_faults"]
        # forward and sample faults come once per step (a few dozen steps here), grammar
        # faults once per constrained request per step; every one must reach a caller
        assert faults["total"] > 0
        seen = {int(m.rsplit("#", 1)[1]) for m in messages if "InjectedFault" in m}
        assert seen == set(range(1, faults["total"] + 1)), "a fault reached no caller"
        for m in messages:  # every abort says why
            if m:
                assert m == "aborted" or m.startswith(("internal error: InjectedFault: ",
                                                       "rejected: ")), m
        # the pool is whole once idle
        deadline = time.monotonic() + 20
        while (info := engine.get_server_info())["num_running_reqs"] and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        pool = info["kv_pool"]
        assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
        assert pool["used_slots"] == 0
        assert pool["free_slots"] + pool["cached_slots"] == pool["total_slots"]
        assert engine.check_health() is None
        print(f"\nstorm: {NUM_REQUESTS} requests in {elapsed:.0f} s, {dict(by_kind)}, "
              f"faults {faults}")
        # the storm over (faults off), the same engine serves normally
        engine.scheduler.faults.probabilities.clear()
        out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 3})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.shutdown()
