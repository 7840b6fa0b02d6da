"""Priorities and per-key limits on a real server, through the official openai client and
/generate: a request's `priority` reaches the scheduler (a full queue drops the lowest, a
429), a key's third request in flight is a 429 with Retry-After while other keys are served,
and without --enable-priority-scheduling a priority is a 400, never silently dropped."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import openai
import pytest

KEYS = ("key-a", "key-b", "key-c")


@pytest.fixture(scope="module")
def server(module_server_launcher: Any, tmp_path_factory: Any) -> Any:
    """Three rows, a queue of one, two requests in flight per key, three keys."""
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("\n".join(KEYS) + "\n")
    path.chmod(0o600)
    return module_server_launcher(
        "--enable-priority-scheduling", "--max-concurrent-requests-per-key", "2",
        "--api-key-file", str(path), "--max-running-requests", "3",
        "--max-queued-requests", "1")


def client(server: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def generate(server: Any, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1}, **body}
    return httpx.post(server.url + "/generate", json=body, headers=headers, timeout=60)


def test_priority_is_taken_by_every_route(server: Any) -> None:
    sdk = client(server, KEYS[0])
    model = sdk.models.list().data[0].id
    chat = sdk.chat.completions.create(model=model, max_tokens=2, extra_body={"priority": 5},
                                       messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].finish_reason == "length"
    done = sdk.completions.create(model=model, prompt="Hi", max_tokens=2,
                                  extra_body={"priority": -3})
    assert done.usage.completion_tokens == 2
    assert generate(server, KEYS[0], priority=7).status_code == 200
    for bad in ("urgent", 1.5, True, 1 << 64):
        r = generate(server, KEYS[0], priority=bad)
        assert r.status_code == 400 and "priority" in r.text, (bad, r.text)
    with pytest.raises(openai.BadRequestError, match="priority"):
        sdk.completions.create(model=model, prompt="Hi", max_tokens=2,
                               extra_body={"priority": "urgent"})


def test_key_limit_and_a_full_queue(server: Any) -> None:
    """Key A holds two streams: its third request is a 429 with Retry-After while key B is
    served beside them. With every row taken and the one queue place held, key C's request
    of the lowest priority is the one the full queue refuses (429), whichever came first;
    its higher-priority one runs once a row frees."""
    a, b, c = (client(server, k) for k in KEYS)
    model = a.models.list().data[0].id
    long = {"model": model, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 400,
            "stream": True, "extra_body": {"ignore_eos": True}}
    streams = [a.completions.create(**long), a.completions.create(**long)]
    try:
        for stream in streams:
            next(stream)  # running
        refused = generate(server, KEYS[0])
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"].isdigit()
        assert "--max-concurrent-requests-per-key 2" in refused.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError, match="requests in flight"):
            a.chat.completions.create(model=model, max_tokens=1,
                                      messages=[{"role": "user", "content": "Hi"}])
        other = b.chat.completions.create(model=model, max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
        assert other.usage.completion_tokens == 2
        streams.append(b.completions.create(**long))
        next(streams[2])  # the third row
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            urgent = pool.submit(c.completions.create, model=model, prompt="Hello",
                                 max_tokens=2, extra_body={"priority": 5})
            try:
                with pytest.raises(openai.RateLimitError, match="waiting queue is full"):
                    c.completions.create(model=model, prompt="Hi", max_tokens=2,
                                         extra_body={"priority": 0})
            finally:
                streams[0].close()  # its row frees
            assert urgent.result(timeout=120).usage.completion_tokens == 2
    finally:
        for stream in streams:
            stream.close()
    # the first stream's end gave its slot back: key A is served again
    assert generate(server, KEYS[0]).status_code == 200


def test_priority_without_priority_scheduling_is_refused(real_server: Any) -> None:
    r = generate(real_server, None, priority=1)
    assert r.status_code == 400 and "--enable-priority-scheduling" in r.text, r.text
    sdk = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="--enable-priority-scheduling"):
        sdk.chat.completions.create(model=model, max_tokens=1, extra_body={"priority": -2},
                                    messages=[{"role": "user", "content": "Hi"}])
    for neutral in (0, None):  # the default, as the peers' clients send it
        assert generate(real_server, None, priority=neutral).status_code == 200
