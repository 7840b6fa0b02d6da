"""Prefill/decode disaggregation behind the real sglang-router 0.3.2 (--pd-disaggregation):
one prefill and one decode worker (real servers, default model) on loopback, KV moved by the
Mooncake Transfer Engine. Greedy output equals a single worker's, streamed and not, through
the native and OpenAI routes; the decode worker computes no prompt token; input logprobs
come through the router as a single worker gives them; the first layer's KV is sent before
the prompt's last layer is computed; and a prefill worker killed mid-transfer ends the
request with an error while the decode worker frees everything.

The tests share one cluster and run in file order; the one that kills the prefill is last.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from router_cluster import PDCluster, info, kill_tree, pd_cluster, sse_events

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="needs sglang-router==0.3.2 (the test extra)"),
]

WORKER_ARGS = ("--max-total-tokens", "16384")
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
TIE_NATS = 0.15  # as tests/constrained/test_engine_jump_forward.py
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Water boils at",
    "Translate to French: good morning",
    "A haiku about the sea:\n",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    with pd_cluster(1, 1, *WORKER_ARGS) as c:
        yield c


def _generate(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    resp = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + "/generate", json={**body, "stream": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    return events[-1]


def test_greedy_same_as_single_worker_and_decode_computes_no_prompt(cluster: PDCluster) -> None:
    single = cluster.prefill[0].url  # a request without a bootstrap room is served whole
    streamed_prompts = [p + " Answer:" for p in PROMPTS]
    ref = [_generate(single, {"text": p, "sampling_params": GREEDY})
           for p in PROMPTS + streamed_prompts]
    # the prefill worker forgets the prompts, so it prefills them whole again below: a radix
    # hit would leave one token to extend, which runs the decode kernels (native on CPU) and
    # sums in another order than the full prefill did
    assert httpx.post(single + "/flush_cache", timeout=30).status_code == 200
    dec_before, pre_before = info(cluster.decode[0].url), info(single)
    # one at a time: the same batches as the single worker ran, so the same floats
    plain = [_generate(cluster.router_url, {"text": p, "sampling_params": GREEDY})
             for p in PROMPTS]
    streamed = [_stream(cluster.router_url, {"text": p, "sampling_params": GREEDY})
                for p in streamed_prompts]
    for r, out in zip(ref, plain + streamed, strict=True):
        assert out["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"], out
        assert out["output_ids"] == r["output_ids"]
        assert out["text"] == r["text"]
    dec_after, pre_after = info(cluster.decode[0].url), info(single)
    # the decode worker ran no prompt token: every one of them arrived as KV
    assert dec_after["num_computed_prompt_tokens"] == dec_before["num_computed_prompt_tokens"]
    moved = (dec_after["disaggregation"]["num_transferred_tokens"]
             - dec_before["disaggregation"]["num_transferred_tokens"])
    # ... except the prefixes its own tree held ("<prompt> Answer:" after "<prompt>")
    assert moved == sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"]
                        for o in plain + streamed)
    assert sum(o["meta_info"]["cached_tokens"] for o in streamed) > 0
    assert (dec_after["disaggregation"]["num_received"]
            - dec_before["disaggregation"]["num_received"]) == len(ref)
    assert (pre_after["disaggregation"]["num_transfers"]
            - pre_before["disaggregation"]["num_transfers"]) == len(ref)
    # what the decode worker received, its tree keeps: the same prompt again moves nothing
    again = _generate(cluster.router_url, {"text": PROMPTS[0], "sampling_params": GREEDY})
    assert again["output_ids"] == ref[0]["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"]
    assert info(cluster.decode[0].url)["disaggregation"]["num_transferred_tokens"] == (
        dec_after["disaggregation"]["num_transferred_tokens"])
    _assert_decode_idle(cluster)


def test_concurrent_requests_through_pd_router(cluster: PDCluster) -> None:
    """Eight at once (batched on both workers): all answered, greedy up to float ties (the
    batch changes the floats; a token may differ only where the single worker's top two
    were within TIE_NATS)."""
    prompts = [f"Request {i} of a concurrent group: tell me about the number {i}."
               for i in range(8)]
    ref = [_generate(cluster.prefill[0].url, {
        "text": p, "sampling_params": GREEDY, "return_logprob": True,
        "top_logprobs_num": 2}) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _generate(
            cluster.router_url, {"text": p, "sampling_params": GREEDY}), prompts))
    for r, out in zip(ref, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop"), out
        got, want = out["output_ids"], r["output_ids"]
        k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if k is None:
            assert got == want
            continue
        top = r["meta_info"]["output_top_logprobs"][k]
        assert got[k] == top[1][1] and top[0][0] - top[1][0] < TIE_NATS, (k, top)
    _assert_decode_idle(cluster)


def test_input_logprobs_through_router_same_as_single_worker(cluster: PDCluster) -> None:
    body = {"text": "Logprobs of a prompt that neither worker has seen yet, please.",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}
    via_router = _generate(cluster.router_url, body)
    direct = _generate(cluster.prefill[0].url, body)
    got = via_router["meta_info"]["input_token_logprobs"]
    want = direct["meta_info"]["input_token_logprobs"]
    assert len(got) == len(want) == direct["meta_info"]["prompt_tokens"]
    for (lp_got, tok_got, _), (lp_want, tok_want, _) in zip(got, want, strict=True):
        assert tok_got == tok_want
        if lp_want is None:
            assert lp_got is None
        else:
            assert lp_got == pytest.approx(lp_want, abs=1e-4)
    assert via_router["output_ids"] == direct["output_ids"]
    out_got = [lp for lp, _, _ in via_router["meta_info"]["output_token_logprobs"]]
    out_want = [lp for lp, _, _ in direct["meta_info"]["output_token_logprobs"]]
    assert out_got == pytest.approx(out_want, abs=1e-4)


def test_openai_chat_through_pd_router(cluster: PDCluster) -> None:
    import openai

    messages = [{"role": "user", "content": "Name a large animal."}]
    direct = openai.OpenAI(base_url=cluster.prefill[0].url + "/v1", api_key="none")
    routed = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="none")
    kwargs = {"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0}
    want = direct.chat.completions.create(**kwargs).choices[0].message.content
    got = routed.chat.completions.create(**kwargs).choices[0].message.content
    assert got == want
    chunks = routed.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_json_schema_through_pd_router(cluster: PDCluster) -> None:
    """The first token is sampled under the grammar on the prefill worker; the decode worker
    advances its own copy of the grammar by it and goes on under the mask."""
    import json as _json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"text": "Give a person as JSON:", "sampling_params": {
        "max_new_tokens": 48, "temperature": 0.0, "json_schema": _json.dumps(schema)}}
    got = _generate(cluster.router_url, body)
    want = _generate(cluster.prefill[0].url, body)
    jsonschema.validate(_json.loads(got["text"]), schema)
    assert got["text"] == want["text"]


def test_first_layer_sent_before_last_layer_computed(cluster: PDCluster) -> None:
    text = "Notes on the layer-wise transfer. " + " ".join(
        f"Sentence {i} of a long prompt about rivers and stones." for i in range(130))
    out = _generate(cluster.router_url,
                    {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert out["meta_info"]["prompt_tokens"] > 1000
    record = info(cluster.prefill[0].url)["disaggregation"]["recent_transfers"][-1]
    assert record["tokens"] == out["meta_info"]["prompt_tokens"]
    computed, sent = record["layer_computed"], record["layer_sent"]
    assert len(computed) == len(sent) == 30  # one write per layer (one prefill chunk)
    # layer 0 was in the decode worker's memory while later layers were still computing
    assert sent[0] < computed[-1], (sent[0] - computed[0], computed[-1] - computed[0])
    assert all(s >= c for s, c in zip(sent, computed, strict=True))
    slot_bytes = info(cluster.decode[0].url)["kv_pool"]["bytes_per_slot"]  # K+V, all layers
    assert record["bytes"] == out["meta_info"]["prompt_tokens"] * slot_bytes


def test_killed_prefill_mid_transfer_ends_request_and_frees_decode(cluster: PDCluster) -> None:
    text = "A prompt long enough to be killed in the middle of. " + " ".join(
        f"Line {i}: the prefill worker computes this while the decode worker waits."
        for i in range(220))
    decode = cluster.decode[0].url
    result: dict[str, Any] = {}

    def send() -> None:
        t0 = time.monotonic()
        try:
            resp = httpx.post(cluster.router_url + "/generate", timeout=120, json={
                "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
            result["status"], result["body"] = resp.status_code, resp.text
        except httpx.HTTPError as exc:
            result["status"], result["body"] = None, repr(exc)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 60
    while info(decode)["disaggregation"]["num_inflight"] == 0:
        assert time.monotonic() < deadline, "the decode worker never registered the request"
        time.sleep(0.05)
    time.sleep(0.2)  # the prefill worker is in its forward, streaming layers
    kill_tree(cluster.prefill[0].proc.pid)
    t_kill = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the client hangs"
    # the client got an error, not text
    assert result["status"] != 200 or '"abort"' in result["body"], result
    deadline = time.monotonic() + 15
    while True:
        d = info(decode)
        idle = (d["disaggregation"]["num_inflight"] == 0 and d["kv_pool"]["used_slots"] == 0
                and d["disaggregation"]["num_quarantined_slots"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, d
    assert time.monotonic() - t_kill < 15
    # and it goes on serving
    out = _generate(decode, {"text": PROMPTS[1], "sampling_params": GREEDY})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def _assert_decode_idle(cluster: PDCluster) -> None:
    d = info(cluster.decode[0].url)
    assert d["disaggregation"]["num_inflight"] == 0
    assert d["disaggregation"]["num_quarantined_slots"] == 0
    assert d["kv_pool"]["used_slots"] == 0


def test_failed_prefill_step_answers_the_client_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill worker whose forward fails (every one, injected) tells the decode worker at
    once: the client behind the router gets its error in seconds, not after the transfer
    timeout (120 s), and the decode worker holds nothing afterwards. Before the fix the
    failed step was the loop's last, and nobody sent Failed until the timeout."""
    monkeypatch.setenv("SGLANG_LIKE_FAULT_INJECT", "forward=1.0,seed=3")
    with pd_cluster(1, 1, *WORKER_ARGS) as c:
        t0 = time.monotonic()
        resp = httpx.post(c.router_url + "/generate", timeout=60, json={
            "text": PROMPTS[0], "sampling_params": GREEDY})
        seconds = time.monotonic() - t0
        assert seconds < 20, seconds
        assert resp.status_code != 200 or '"abort"' in resp.text, resp.text
        assert "injected" in resp.text.lower() or "internal error" in resp.text, resp.text
        deadline = time.monotonic() + 15
        while True:
            d = info(c.decode[0].url)
            idle = (d["disaggregation"]["num_inflight"] == 0 and d["kv_pool"]["used_slots"] == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, d
