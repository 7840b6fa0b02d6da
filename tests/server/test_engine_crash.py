"""The engine core is a process of its own behind the HTTP server: when it dies, the HTTP side
sees it — every request in flight ends with an error within seconds, /health turns 503 with
the reason, later requests are answered at once, and the server still stops cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow
DIED = "internal error: the engine process exited with code -9"
LONG = {"max_new_tokens": 4000, "ignore_eos": True}


def test_killing_the_engine_process_ends_requests_and_turns_health_503(
        server_launcher: Any) -> None:
    server = server_launcher("--max-total-tokens", "8192")
    url = server.url
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    engine_pid = info["engine_pid"]
    http_proc = psutil.Process(server.proc.pid)
    assert engine_pid != server.proc.pid
    assert engine_pid in [p.pid for p in http_proc.children(recursive=True)]

    async def in_flight() -> tuple[list[Any], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            async def native() -> Any:
                r = await client.post(url + "/generate", json={"text": "Hi",
                                                               "sampling_params": LONG})
                return r.status_code, r.json()

            async def chat() -> Any:
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": "x", "max_tokens": 4000,
                    "messages": [{"role": "user", "content": "Write a long story"}]})
                return r.status_code, r.json()

            async def streamed() -> Any:
                events = []
                async with client.stream("POST", url + "/generate", json={
                        "text": "Hello", "stream": True, "sampling_params": LONG}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return r.status_code, events

            tasks = [asyncio.ensure_future(f()) for f in (native, native, chat, streamed)]
            deadline = time.monotonic() + 60
            while True:  # every request is running before the kill
                load = (await client.get(url + "/get_load")).json()[0]
                if load["num_reqs"] == 4 and load["num_waiting_reqs"] == 0:
                    break
                assert time.monotonic() < deadline, load
                await asyncio.sleep(0.05)
            os.kill(engine_pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            return results, time.monotonic() - t0

    results, elapsed = asyncio.run(in_flight())
    assert elapsed < 5, f"requests took {elapsed:.1f} s to learn the engine died"
    (c1, n1), (c2, n2), (c3, chat), (c4, events) = results
    for code, body in ((c1, n1), (c2, n2)):  # SGLang's shape: 200, the abort in meta_info
        assert code == 200 and body["meta_info"]["finish_reason"]["message"] == DIED
    assert c3 == 500 and DIED in chat["error"]["message"]
    assert c4 == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["message"] == DIED

    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and "exited with code -9" in health.text
    t0 = time.monotonic()
    late = httpx.post(url + "/generate", timeout=10,
                      json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert late.json()["meta_info"]["finish_reason"]["message"] == DIED
    assert time.monotonic() - t0 < 2
    late_chat = httpx.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "x", "messages": [{"role": "user", "content": "Hi"}]})
    assert late_chat.status_code == 500
    metrics = httpx.get(url + "/metrics", timeout=10)  # the counters are still there
    assert metrics.status_code == 200 and "sglang_like" in metrics.text
    assert server.proc.poll() is None  # the HTTP side goes on answering
    assert server_launcher.stop(server, timeout=30) == 0
