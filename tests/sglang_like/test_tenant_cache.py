"""Tenant isolation in a real engine's radix cache (issue #49): a prompt cached under one
cache_salt is no hit, and no `cached_tokens`, under another (vLLM's CVE-2025-46570 class:
a tenant timing or counting another's prefixes); the same salt hits as before. And, on the
same engine, a text prompt of async_generate is tokenized off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_like import Engine

pytestmark = pytest.mark.slow

SP = {"max_new_tokens": 2, "temperature": 0.0}
PROMPT = "A system prompt long enough to be worth caching, shared by the tenants: " * 3


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(max_total_tokens=4096, log_level="warning") as e:
        yield e


def _cached(engine: Engine, salt: str | None) -> int:
    return engine.generate(PROMPT, SP, cache_salt=salt)["meta_info"]["cached_tokens"]


def test_salts_share_no_prefix(engine: Engine) -> None:
    assert _cached(engine, "tenant-a") == 0
    hit = _cached(engine, "tenant-a")
    assert hit > 20
    assert _cached(engine, "tenant-b") == 0
    assert _cached(engine, None) == 0
    assert _cached(engine, None) == hit  # the shared namespace works as it always did
    info = engine.get_server_info()
    assert info["kv_pool"]["used_slots"] == 0
    # three copies of the prompt now sit in the tree, one per namespace
    assert info["kv_pool"]["cached_slots"] >= 3 * hit


def test_bad_salt_is_a_value_error(engine: Engine) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate("x", SP, cache_salt=5)  # type: ignore[arg-type]


def test_text_is_tokenized_off_the_event_loop(engine: Engine, monkeypatch: Any) -> None:
    threads: list[threading.Thread] = []
    encode = engine.tokenizer.encode

    def recording_encode(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", recording_encode)

    async def run() -> tuple[dict, threading.Thread]:
        return await engine.async_generate("Hello there", SP), threading.current_thread()

    out, loop_thread = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert threads and all(t is not loop_thread for t in threads)
