"""Unit tests of the HTTP layer over a fake engine: shapes, errors, auth, 429, disconnects, metrics.

The fake engine stands in for the model only; real-model behaviour is proven in the
test_real_*.py files of this folder.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

LONG = "x" * 300  # the fake engine's context is 256 tokens (one per character)

BAD_NATIVE = [
    ("not json", b"{not json", "not valid JSON"),
    ("not utf-8", b'{"text": "\xff\xfe"}', "UTF-8"),
    ("array body", b"[1, 2]", "JSON object"),
    ("no prompt", {"sampling_params": {}}, "text"),
    ("text and ids", {"text": "a", "input_ids": [1]}, "exactly one"),
    ("text wrong type", {"text": 5}, "text"),
    ("empty text", {"text": ""}, "empty"),
    ("empty ids", {"input_ids": []}, "empty"),
    ("negative max", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("absurd max", {"text": "a", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ("max as string", {"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ("temperature < 0", {"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ("top_p 0", {"text": "a", "sampling_params": {"top_p": 0.0}}, "top_p"),
    ("top_p > 1", {"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("unknown param", {"text": "a", "sampling_params": {"tempreature": 1}}, "tempreature"),
    ("sampling not dict", {"text": "a", "sampling_params": "hot"}, "sampling_params"),
    ("stream not bool", {"text": "a", "stream": "yes"}, "stream"),
    ("too long", {"text": LONG}, "longer"),
    ("too long stream", {"text": LONG, "stream": True}, "longer"),
    ("bad logprob start", {"text": "a", "logprob_start_len": -5}, "logprob_start_len"),
    ("huge logprob start", {"text": "a", "logprob_start_len": 1 << 70}, "logprob_start_len"),
]


@pytest.mark.parametrize(("name", "body", "needle"), BAD_NATIVE, ids=[b[0] for b in BAD_NATIVE])
def test_native_bad_input_is_400(fake_server: Any, name: str, body: Any, needle: str) -> None:
    r = _post(fake_server.url + "/generate", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert needle.lower() in message.lower(), message


BAD_OPENAI = [
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": LONG}, "longer"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n must"),
    ("/v1/completions", {"prompt": "a", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, "role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "context"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, "at least 1"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "logprobs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "presence_penalty": 5}, "presence_penalty"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "regex": "a", "response_format":
      {"type": "json_object"}}, "only one"),
    ("/v1/chat/completions", b"\x80\x81", "UTF-8"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_OPENAI)
def test_openai_bad_input_is_400_in_openai_shape(
    fake_server: Any, path: str, body: Any, needle: str
) -> None:
    r = _post(fake_server.url + path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert needle.lower() in error["message"].lower(), error["message"]


def test_native_generate_shapes(fake_server: Any) -> None:
    url = fake_server.url + "/generate"
    single = _post(url, {"text": "hello", "sampling_params": {"max_new_tokens": 3}}).json()
    assert single["text"] == "fgh" and single["meta_info"]["completion_tokens"] == 3
    assert single["meta_info"]["finish_reason"]["type"] == "length"
    batch = _post(url, {"text": ["ab", "abc"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["text"] for b in batch] == ["cd", "de"]
    ids = _post(url, {"input_ids": [[97, 98], [97]], "sampling_params": {"max_new_tokens": 1}})
    assert [b["text"] for b in ids.json()] == ["c", "b"]
    n2 = _post(url, {"text": "ab", "sampling_params": {"max_new_tokens": 1, "n": 2}}).json()
    assert isinstance(n2, list) and len(n2) == 2


def test_sglang_client_extras_are_accepted(fake_server: Any) -> None:
    """RuntimeEndpoint sends these keys; unset ones must not be rejected."""
    body = {
        "text": ["The answer is yes", "The answer is no"],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0, "stop": [],
                            "stop_token_ids": None, "stop_regex": None,
                            "spaces_between_special_tokens": True},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 12,
    }
    out = _post(fake_server.url + "/generate", body).json()
    for item in out:
        logprobs = item["meta_info"]["input_token_logprobs"]
        assert all(len(lp) == 3 and isinstance(lp[1], int) for lp in logprobs)
        assert "".join(lp[2] for lp in logprobs) == body["text"][out.index(item)][12:]
    assert fake_server.engine.calls[-1]["logprob_start_len"] == 12
    bad = dict(body, sampling_params={"stop_regex": "x+"})
    assert _post(fake_server.url + "/generate", bad).status_code == 400


def test_native_stream_is_cumulative_with_new_logprobs(fake_server: Any) -> None:
    body = {"text": "ab", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4}}
    events = _sse(fake_server.url + "/generate", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["text"] for c in chunks] == ["c", "cd", "cde", "cdef"]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == 1 for c in chunks)
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_shapes(fake_server: Any) -> None:
    url = fake_server.url
    comp = _post(url + "/v1/completions",
                 {"prompt": ["ab", "xy"], "max_tokens": 2, "n": 2, "logprobs": 2}).json()
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2, 3]
    assert comp["choices"][0]["logprobs"]["tokens"] == ["c", "d"]
    assert comp["usage"]["completion_tokens"] == 8 and comp["usage"]["prompt_tokens"] == 4
    chat = _post(url + "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "max_tokens": 2, "logprobs": True, "top_logprobs": 2}).json()
    choice = chat["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 2
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    prompt = fake_server.engine.calls[-1]["input_ids"]
    assert "".join(map(chr, prompt)) == "<user>hi<assistant>"
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "fake-model"


def test_openai_chat_stream_with_n_and_usage(fake_server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    events = _sse(fake_server.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content", "")
    assert len(text[0]) == 3 and len(text[1]) == 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_api_key(fake_server_factory: Any) -> None:
    server = fake_server_factory(api_key="s3cret")
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, path in [("GET", "/get_model_info"), ("GET", "/metrics"),
                             ("POST", "/generate"), ("GET", "/v1/models")]:
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
    ok = httpx.post(server.url + "/generate", json=body,
                    headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_queue_full_gives_429_at_once(fake_server_factory: Any) -> None:
    server = fake_server_factory(step_s=0.05, max_running_requests=1, max_queued_requests=2)

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> tuple[int, float]:
                t0 = time.monotonic()
                r = await client.post(server.url + "/generate", json={
                    "text": "a", "sampling_params": {"max_new_tokens": 8}})
                return r.status_code, time.monotonic() - t0
            first = asyncio.ensure_future(one())
            await asyncio.sleep(0.1)
            rest = await asyncio.gather(*(one() for _ in range(8)))
            return [(await first)[0]] + [code for code, _ in rest], rest

    codes, rest = asyncio.run(main())
    assert codes.count(200) >= 3 and codes.count(429) >= 1, codes
    assert all(dt < 0.3 for code, dt in rest if code == 429)


def test_client_disconnect_mid_stream_aborts_and_frees(fake_server: Any) -> None:
    engine = fake_server.engine
    body = {"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 200}}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", fake_server.url + "/generate", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data:") for line in got)
    deadline = time.monotonic() + 5
    while engine.used_slots and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.used_slots == 0
    assert engine.aborted, "the engine stream was not closed"
    info = httpx.get(fake_server.url + "/get_server_info").json()
    assert info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0


def test_client_disconnect_non_stream_aborts(fake_server: Any) -> None:
    engine = fake_server.engine
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 400}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/generate", json=body, timeout=0.3)
    deadline = time.monotonic() + 5
    while engine.used_slots and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.used_slots == 0 and engine.aborted


def test_metrics_parse_and_move(fake_server: Any) -> None:
    def sample(name: str, **labels: str) -> float:
        text = httpx.get(fake_server.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    before = sample("sglang_like_generation_tokens_total")
    _post(fake_server.url + "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 3}})
    _sse(fake_server.url + "/generate",
         {"text": "ab", "stream": True, "sampling_params": {"max_new_tokens": 2}})
    assert sample("sglang_like_generation_tokens_total") == before + 5
    assert sample("sglang_like_requests_total", finish_reason="length") >= 2
    assert sample("sglang_like_time_to_first_token_seconds_count") >= 1
    assert sample("sglang_like_inter_token_latency_seconds_count") >= 1
    assert sample("sglang_like_cached_tokens_total") >= 1  # the repeated prompt
    assert sample("sglang_like_e2e_request_latency_seconds_count") >= 2


def test_info_routes(fake_server: Any) -> None:
    url = fake_server.url
    info = httpx.get(url + "/get_model_info").json()
    assert info["model_path"].endswith(".gguf") and info["chat_template"]
    server_info = httpx.get(url + "/server_info").json()
    assert server_info["kv_pool"]["total_slots"] == 4096
    assert httpx.post(url + "/flush_cache").status_code == 200
    assert httpx.post(url + "/abort_request", json={"rid": "nope"}).status_code == 200
    assert httpx.post(url + "/abort_request", json={}).status_code == 400
    assert httpx.get(url + "/health_generate").status_code == 200


def _post(url: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    return httpx.post(url, json=body, timeout=30)


def _sse(url: str, body: dict) -> list[str]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


@pytest.mark.parametrize(("path", "method", "engine_call"), [
    ("/metrics", "GET", "get_server_info"), ("/get_server_info", "GET", "get_server_info"),
    ("/get_load", "GET", "get_load"), ("/flush_cache", "POST", "flush_cache"),
    ("/stats", "GET", "get_stats"),
])
def test_routes_that_ask_the_engine_do_not_block_the_event_loop(
        fake_server: Any, path: str, method: str, engine_call: str) -> None:
    """The engine answers between steps (a long prefill can take seconds): while it has not,
    the server still answers everyone else."""
    import threading

    engine = fake_server.engine
    real = getattr(engine, engine_call, None)
    entered, release = threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(10)
        if real is None:  # the fake engine has no stats: what a real one answers
            return {"t": 0.0, "kv_pool": {"total_slots": 1, "free_slots": 1, "used_slots": 0,
                                          "evictable_slots": 0},
                    "num_running_reqs": 0, "num_queued_reqs": 0, "num_prompt_tokens": 0,
                    "num_cached_prompt_tokens": 0, "num_generated_tokens": 0,
                    "num_forward_steps": 0, "evicted_tokens": 0, "num_tree_nodes": 0,
                    "dashboard_busy_s": 0.0, "spec_accept_lengths": {}, "latency": {}}
        return real(*args, **kwargs)

    setattr(engine, engine_call, slow)
    answers: list[int] = []
    caller = threading.Thread(target=lambda: answers.append(
        httpx.request(method, fake_server.url + path, timeout=30).status_code))
    caller.start()
    try:
        assert entered.wait(10), f"{path} never asked the engine"
        r = httpx.get(fake_server.url + "/health", timeout=5)  # blocked loop: a timeout here
        assert r.status_code == 200 and not release.is_set()
    finally:
        release.set()
        caller.join(timeout=30)
    assert answers == [200], (path, answers)
