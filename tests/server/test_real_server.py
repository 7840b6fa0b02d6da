"""The server with the real default model on loopback: OpenAI client, native protocol, errors,
cancellation, load and metrics. One server process is shared by this file (session fixture)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(real_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", timeout=120)


# ---- the official openai client -----------------------------------------------------------
def test_openai_completion_and_chat(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    comp = client.completions.create(model=model, prompt="One, two, three,", max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")
    assert 0 < comp.usage.completion_tokens <= MAX_TOKENS and comp.usage.prompt_tokens > 0
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=MAX_TOKENS, temperature=0, seed=1,
    )
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_openai_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    parts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(parts) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_openai_n2_and_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say something."}], max_tokens=4, n=2,
        temperature=1.0, logprobs=True, top_logprobs=3,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        content = choice.logprobs.content
        assert 0 < len(content) <= 4
        for entry in content:
            assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            assert entry.logprob <= tops[0] + 1e-4
    comp = client.completions.create(model="m", prompt="The sky is", max_tokens=3, logprobs=2,
                                     temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text
    # greedy: the chosen token is the most likely one
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert max(top, key=top.get) == token


def test_openai_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    system = "You are a careful assistant who answers in one short sentence. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi there"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens // 2, (cached, first.usage)


def test_a_list_of_prompts_and_n_choices_prefill_together(real_server: Any,
                                                          client: openai.OpenAI) -> None:
    """The prompts of one /v1/completions request, and a chat's n choices, reach the scheduler
    together: one step prefills them all, then one decode step a token (sent one by one, part
    of them could be prefilled a step later, and their text depended on timing)."""
    def steps() -> int:
        return httpx.get(real_server.url + "/get_server_info").json()["num_forward_steps"]

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
    for trial in range(4):  # 12 new prompts of ~110 tokens (a split was seen 1 in 3 before)
        prompts = [f"{trial}.{i}: " + " ".join(words[(i + j) % 14] for j in range(100))
                   for i in range(12)]
        before = steps()
        out = client.completions.create(model="m", prompt=prompts, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in out.choices] == ["length"] * 12
        assert steps() - before == 3
    # n choices share their whole prompt: from an empty cache one prefills it, the other five
    # wait a step to reuse its KV (IN_BATCH_SHARE_THRESHOLD) and join as decode rows, so one
    # step more (with the chat template's system prompt cached by earlier tests, none waits)
    assert httpx.post(real_server.url + "/flush_cache").status_code == 200
    before = steps()
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a colour."}], n=6, max_tokens=5,
        temperature=0.8, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 6 and steps() - before == 6


# ---- native protocol ----------------------------------------------------------------------
def test_native_select_shape(real_server: Any) -> None:
    """What SGLang's select() sends: cache the prefix, then score each choice by logprobs."""
    url = real_server.url + "/generate"
    prefix = "Question: is fire hot?\nAnswer:"
    pre = httpx.post(url, json={"text": prefix, "sampling_params": {"max_new_tokens": 0}},
                     timeout=60).json()
    prompt_len = pre["meta_info"]["prompt_tokens"]
    assert pre["meta_info"]["completion_tokens"] == 0
    start = max(prompt_len - 2, 0)
    choices = [" yes", " no", " maybe so"]
    out = httpx.post(url, json={
        "text": [prefix + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start,
    }, timeout=60).json()
    assert isinstance(out, list) and len(out) == 3
    for choice, item in zip(choices, out, strict=True):
        meta = item["meta_info"]
        lps = meta["input_token_logprobs"]
        assert len(lps) == meta["prompt_tokens"] - start
        assert all(len(e) == 3 and isinstance(e[1], int) and isinstance(e[2], str) for e in lps)
        assert all(e[0] is None or e[0] <= 0.0 for e in lps)
        assert "".join(e[2] for e in lps).endswith(choice)
        assert meta["output_token_logprobs"] == []
    ids = [[e[1] for e in item["meta_info"]["input_token_logprobs"]] for item in out]
    uncond = httpx.post(url, json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": 0},
                        timeout=60).json()
    for row, item in zip(ids, uncond, strict=True):
        lps = item["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in lps] == row and lps[0][0] is None


def test_native_stream_with_logprobs_matches_non_stream(real_server: Any) -> None:
    url = real_server.url + "/generate"
    body = {"text": "Once upon a time", "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    # both from a cold cache: a radix hit runs the last prompt token through another kernel,
    # which under the default bf16 activations moves logprobs by ~1e-3 (a different path,
    # not a streaming difference)
    assert httpx.post(real_server.url + "/flush_cache", timeout=60).status_code == 200
    full = httpx.post(url, json=body, timeout=60).json()
    chunks = []
    assert httpx.post(real_server.url + "/flush_cache", timeout=60).status_code == 200
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"])
    last = chunks[-1]
    assert last["text"] == full["text"]
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    streamed = [e for c in chunks for e in c["meta_info"].get("output_token_logprobs", [])]
    assert [e[1] for e in streamed] == full["output_ids"]
    assert last["meta_info"]["output_token_logprobs_length"] == len(full["output_ids"])
    for a, b in zip(streamed, full["meta_info"]["output_token_logprobs"], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-3)


BAD = [
    ({"text": "hello " * 9000, "sampling_params": {"max_new_tokens": 4}}, "context"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -4}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": ""}, "empty"),
    ({"text": 17}, "text"),
]


@pytest.mark.parametrize(("body", "needle"), BAD)
def test_real_bad_input_is_400(real_server: Any, body: dict, needle: str) -> None:
    r = httpx.post(real_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"].lower()
    # a JSON body (as its Content-Type says) that is not UTF-8; without the header it is a 415
    r = httpx.post(real_server.url + "/generate", content=b'{"text": "\xff"}', timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400


# ---- cancellation, load, metrics ----------------------------------------------------------
def test_fifty_dropped_streams_free_their_slots(real_server: Any) -> None:
    url = real_server.url
    body = {"sampling_params": {"max_new_tokens": 64, "ignore_eos": True}, "stream": True}

    async def drop_midway(client: httpx.AsyncClient, i: int) -> int:
        async with client.stream("POST", url + "/generate",
                                 json={**body, "text": f"Story number {i}:"}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 2:
                    return r.status_code
        return r.status_code

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(drop_midway(client, i) for i in range(50)))

    assert asyncio.run(main()) == [200] * 50
    deadline = time.monotonic() + 60
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        pool = info["kv_pool"]
        if pool["used_slots"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert pool["used_slots"] == 0, pool
    assert pool["free_slots"] + pool["cached_slots"] == pool["total_slots"], pool
    assert info["num_running_reqs"] == 0
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and time.monotonic() - t0 < 15


def test_hundred_concurrent_mixed_requests(real_server: Any) -> None:
    url = real_server.url

    async def one(client: httpx.AsyncClient, i: int) -> int:
        words = " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4] * (1 + i % 7))
        max_tokens = 1 + i % MAX_TOKENS
        if i % 3 == 0:
            r = await client.post(url + "/v1/completions", json={
                "prompt": words, "max_tokens": max_tokens, "temperature": 0.7})
        elif i % 3 == 1:
            r = await client.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens})
        else:
            r = await client.post(url + "/generate", json={
                "text": words, "sampling_params": {"max_new_tokens": max_tokens}})
        return r.status_code

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    assert asyncio.run(main()) == [200] * 100


def test_metrics_parse_and_counters_move(real_server: Any) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(real_server.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
                out[key] = s.value
        return out

    before = scrape()
    r = httpx.post(real_server.url + "/generate", json={
        "text": "Metrics please", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        timeout=60)
    assert r.status_code == 200
    with httpx.stream("POST", real_server.url + "/generate", json={
            "text": "Metrics please", "stream": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}, timeout=60) as s:
        assert s.status_code == 200 and list(s.iter_lines())
    after = scrape()
    gen = "sglang_like_generation_tokens_total"
    assert after[gen] - before.get(gen, 0) == 6
    assert after["sglang_like_prompt_tokens_total"] > before.get(
        "sglang_like_prompt_tokens_total", 0)
    reqs = "sglang_like_requests_total|finish_reason=length"
    assert after[reqs] - before.get(reqs, 0) == 2
    ttft = "sglang_like_time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == 1
    assert after["sglang_like_cached_tokens_total"] > before.get(
        "sglang_like_cached_tokens_total", 0)
    for gauge in ("sglang_like_kv_pool_usage", "sglang_like_cache_hit_rate",
                  "sglang_like_num_running_reqs", "sglang_like_num_queued_reqs"):
        assert gauge in after
    assert 0.0 < after["sglang_like_cache_hit_rate"] <= 1.0
