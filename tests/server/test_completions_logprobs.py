"""/v1/completions as evaluation harnesses use it, against a real server (default model): echo
with logprobs covers the prompt tokens (the first one null) then the generated ones, top-k for
both, text offsets that index the echoed text; max_tokens=0 scores the prompt only; prompts as
token ids; the same in a stream. The prompt logprobs equal what /generate reports."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"


def _complete(server: Any, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "temperature": 0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _native_prompt_logprobs(server: Any, **prompt: Any) -> list[list[Any]]:
    r = httpx.post(server.url + "/generate", json={
        **prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0, "return_text_in_logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["input_token_logprobs"]


def _check_offsets(lp: dict[str, Any], text: str) -> None:
    assert "".join(lp["tokens"]) == text
    offsets = [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token


def test_echo_logprobs_cover_prompt_then_output(real_server: Any) -> None:
    out = _complete(real_server, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True)
    choice, usage = out["choices"][0], out["usage"]
    lp = choice["logprobs"]
    num_prompt, num_out = usage["prompt_tokens"], usage["completion_tokens"]
    assert num_out == 3 and choice["finish_reason"] == "length"
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert len(lp["tokens"]) == num_prompt + num_out
    _check_offsets(lp, choice["text"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:], strict=True):
        assert value <= 0 and 1 <= len(top) <= 3  # the top 2 and the chosen token
        assert top[token] == pytest.approx(value, abs=1e-6)
        assert max(top.values()) >= value - 1e-6
    for token, value, top in zip(lp["tokens"][num_prompt:], lp["token_logprobs"][num_prompt:],
                                 lp["top_logprobs"][num_prompt:], strict=True):
        assert max(top, key=top.get) == token and len(top) == 2  # greedy: chosen is the top
        assert max(top.values()) == pytest.approx(value, abs=1e-6)
    native = _native_prompt_logprobs(real_server, text=PROMPT)
    assert [e[2] for e in native] == lp["tokens"][:num_prompt]
    assert native[0][0] is None
    assert [e[0] for e in native[1:]] == pytest.approx(lp["token_logprobs"][1:num_prompt],
                                                       abs=1e-4)


def test_max_tokens_zero_scores_the_prompt(real_server: Any) -> None:
    scored = _complete(real_server, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice, usage = scored["choices"][0], scored["usage"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"]
    _check_offsets(lp, PROMPT)
    # what lm-eval sends (max_tokens 1): the same prompt logprobs, then one generated token
    one = _complete(real_server, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True)
    values = one["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == usage["prompt_tokens"] + 1
    assert values[0] is None and lp["token_logprobs"][0] is None
    assert values[1:-1] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    plain = _complete(real_server, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    refused = httpx.post(real_server.url + "/v1/completions",
                         json={"model": "m", "prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]


def test_token_id_prompts_and_logprobs_zero(real_server: Any) -> None:
    native = _native_prompt_logprobs(real_server, text=PROMPT)
    ids = [e[1] for e in native]
    # lm-eval's shape: [[ids]]; logprobs=0: each top names the chosen token only
    lp = _complete(real_server, prompt=[ids], max_tokens=0, logprobs=0,
                   echo=True)["choices"][0]["logprobs"]
    assert lp["tokens"] == [e[2] for e in native]
    assert all(top == {tok: v} for tok, v, top in zip(
        lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True))
    assert lp["token_logprobs"][1:] == pytest.approx([e[0] for e in native[1:]], abs=1e-4)
    # two prompts in one body (one forward: values differ in the last bits, not checked here)
    other = ids[:5]
    out = _complete(real_server, prompt=[ids, other], max_tokens=0, logprobs=0, echo=True)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, row in zip(out["choices"], (ids, other), strict=True):
        assert choice["logprobs"]["tokens"] == [e[2] for e in native[: len(row)]]
        assert choice["text"] == "".join(e[2] for e in native[: len(row)])
    assert out["usage"]["prompt_tokens"] == len(ids) + len(other)


def _stream(server: Any, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": "m", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_stream_echo_carries_prompt_logprobs(real_server: Any, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 2, "echo": True}
    full = _complete(real_server, **body)["choices"][0]
    chunks = _stream(real_server, **body)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"] == PROMPT and choices[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in choices) == full["text"]
    assert choices[-1]["finish_reason"] == full["finish_reason"] == "length"
    joined: dict[str, list] = {k: [] for k in full["logprobs"]}
    for c in choices:
        for k in joined:
            joined[k] += (c["logprobs"] or {}).get(k, [])
    assert joined["tokens"] == full["logprobs"]["tokens"]
    assert joined["text_offset"] == full["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:],
                                                         abs=1e-4)
