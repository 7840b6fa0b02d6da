"""vLLM's cancellation shape on a real server (default model): 64 long streams whose clients
give up after 0.5 s, then a fresh request is answered at once and nothing is left held; and
the same for streams dropped mid-decode (0.5 s after their first event)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_STREAMS = 64
NUM_STREAMS_MID_DECODE = 32
GIVE_UP_AFTER_S = 0.5
MAX_NEW_TOKENS = 512
FRESH_ANSWER_WITHIN_S = 5.0
CLEAN_WITHIN_S = 5.0
# Half run, half wait in the queue: both kinds of request must be dropped when their client goes.
SERVER_ARGS = ("--max-running-requests", "32")


def _bodies(num: int) -> list[tuple[str, dict[str, Any]]]:
    """Mixed /generate and /v1/chat/completions streams, prompts distinct and long-lived."""
    out = []
    for i in range(num):
        topic = f"the history of city number {i}"
        if i % 2 == 0:
            out.append(("/generate", {
                "text": f"Write a very long essay about {topic}.", "stream": True,
                "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}}))
        else:
            out.append(("/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Tell me at length about {topic}."}],
                "stream": True, "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True}))
    return out


async def _give_up(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                   from_first_event: bool) -> int:
    """Stream, then drop the connection GIVE_UP_AFTER_S after the start (or after the first
    event); returns the number of events seen."""
    num_events = 0
    first_event = asyncio.Event()

    async def read() -> None:
        nonlocal num_events
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    num_events += 1
                    first_event.set()
        raise AssertionError(f"a {MAX_NEW_TOKENS}-token stream ended before its client left")

    reader = asyncio.ensure_future(read())
    if from_first_event:
        await asyncio.wait({reader, asyncio.ensure_future(first_event.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
    try:
        await asyncio.wait_for(reader, GIVE_UP_AFTER_S)
    except asyncio.TimeoutError:
        pass  # cancelled: httpx closes the connection of an unfinished response
    return num_events


async def _burst(base: str, num: int, from_first_event: bool = False) -> list[int]:
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_give_up(client, base + path, body, from_first_event)
                                      for path, body in _bodies(num)))


def _assert_recovers(url: str) -> None:
    """A fresh non-streamed request is answered at once; then nothing is held."""
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", timeout=FRESH_ANSWER_WITHIN_S, json={
        "text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0, r.text
    print(f"fresh request answered in {time.monotonic() - t0:.2f} s")
    deadline = time.monotonic() + CLEAN_WITHIN_S
    while True:
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        busy = (info["kv_pool"]["used_slots"], info["num_running_reqs"], info["num_queued_reqs"])
        if busy == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert busy == (0, 0, 0), f"(used_slots, running, queued) = {busy}: {info['kv_pool']}"


def test_clients_that_give_up_free_everything(server_launcher: Any) -> None:
    server = server_launcher(*SERVER_ARGS)
    t0 = time.monotonic()
    events = asyncio.run(_burst(server.url, NUM_STREAMS))
    print(f"{NUM_STREAMS} streams dropped {GIVE_UP_AFTER_S} s after they were sent "
          f"({time.monotonic() - t0:.1f} s); {sum(n > 0 for n in events)} had seen events")
    _assert_recovers(server.url)

    t0 = time.monotonic()
    events = asyncio.run(_burst(server.url, NUM_STREAMS_MID_DECODE, from_first_event=True))
    print(f"{NUM_STREAMS_MID_DECODE} streams dropped {GIVE_UP_AFTER_S} s after their first "
          f"event ({time.monotonic() - t0:.1f} s); {sum(events)} events in all")
    assert all(n > 0 for n in events)
    _assert_recovers(server.url)
