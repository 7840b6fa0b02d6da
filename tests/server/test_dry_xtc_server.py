"""DRY and XTC through the real server: SGLang's sampling_params on /generate, the official
openai client's extra body fields on completions and chat; out-of-range values are 400s."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

LOOP = "1 2 3 1 2 3 1 2 3"  # the default model goes on with " 1 2 3" for ever, greedy
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def _generate(url: str, prompt: str, params: dict, **extra: Any) -> dict:
    r = httpx.post(url + "/generate", timeout=120,
                   json={"text": prompt, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _longest_repeat(ids: list[int], start: int) -> int:
    """The longest run of tokens ending at an output position that also ends earlier."""
    best = 0
    for t in range(start, len(ids)):
        for j in range(t):
            k = 0
            while k <= j and ids[j - k] == ids[t - k]:
                k += 1
            best = max(best, k)
    return best


def test_dry_breaks_a_greedy_loop(real_server: Any) -> None:
    url = real_server.url
    prompt_ids = httpx.post(url + "/tokenize", json={"prompt": LOOP}).json()["tokens"]
    looping = _generate(url, LOOP, GREEDY)
    plain = _longest_repeat(prompt_ids + looping["output_ids"], len(prompt_ids))
    assert plain >= 20, looping["text"]
    dry = _generate(url, LOOP, {**GREEDY, "dry_multiplier": 0.8, "dry_allowed_length": 2})
    assert _longest_repeat(prompt_ids + dry["output_ids"], len(prompt_ids)) <= 2 + 3, dry["text"]
    # the same fields as extra body fields of the OpenAI routes (llama-server's / vLLM's names)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    completion = client.completions.create(
        model="m", prompt=LOOP, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True, "dry_multiplier": 0.8, "dry_allowed_length": 2})
    assert completion.choices[0].text == dry["text"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "Repeat after me: " + LOOP}],
            "max_tokens": 16, "temperature": 0}
    echo = client.chat.completions.create(**chat).choices[0].message.content
    assert echo.startswith("1 2 3 1 2 3 1 2"), echo
    on = client.chat.completions.create(**chat, extra_body={"dry_multiplier": 0.8})
    assert not on.choices[0].message.content.startswith("1 2 3 1 2 3"), on


def test_a_grammar_outranks_dry(real_server: Any) -> None:
    """A regex that demands the repeat gets it: the mask comes after DRY's penalty (which
    stays finite), so the grammar's tokens are still chosen."""
    out = _generate(real_server.url, "Count:", {
        "max_new_tokens": 24, "temperature": 0, "regex": "( 1 2 3){3}",
        "dry_multiplier": 5.0, "dry_allowed_length": 1, "dry_sequence_breakers": []})
    assert out["text"] == " 1 2 3 1 2 3 1 2 3"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_xtc_excludes_top_choices_and_a_seed_reproduces(real_server: Any) -> None:
    """With xtc_probability 1 every step whose model distribution (temperature 1, nothing
    cut) has two or more tokens at 0.1 or above takes none of them but the least likely."""
    params = {"max_new_tokens": 16, "temperature": 1.0, "seed": 11, "ignore_eos": True,
              "xtc_probability": 1.0, "xtc_threshold": 0.1}
    out = _generate(real_server.url, "Once upon a time", params, return_logprob=True,
                    top_logprobs_num=20)
    meta = out["meta_info"]
    acted = 0
    for chosen, tops in zip(out["output_ids"], meta["output_top_logprobs"], strict=True):
        probs = {tok: math.exp(lp) for lp, tok, *_ in tops}
        if any(abs(p - 0.1) < 1e-3 for p in probs.values()):
            continue  # too close to the threshold to judge in float32
        above = sorted((t for t, p in probs.items() if p >= 0.1), key=lambda t: probs[t])
        if len(above) >= 2:
            acted += 1
            assert chosen not in above[1:], (chosen, above, probs)
    assert acted > 0
    again = _generate(real_server.url, "Once upon a time", params)
    assert again["output_ids"] == out["output_ids"]


def test_out_of_range_values_are_400(real_server: Any) -> None:
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", timeout=120)
    for body, field in (({"dry_multiplier": -1}, "dry_multiplier"),
                        ({"dry_base": 0.5}, "dry_base"),
                        ({"xtc_threshold": 2.0}, "xtc_threshold"),
                        ({"xtc_probability": 0.5, "temperature": 0}, "xtc_probability")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="m", prompt="x", max_tokens=1, extra_body=body)
    with pytest.raises(openai.BadRequestError, match="dry_penalty_last_n"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, extra_body={"dry_penalty_last_n": -5})
    for params, message in (({"dry_sequence_breakers": [""]}, "1 to 40 characters"),
                            ({"dry_allowed_length": 0}, "dry_allowed_length must be in")):
        r = httpx.post(real_server.url + "/generate",
                       json={"text": "x", "sampling_params": params})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.get(real_server.url + "/health").status_code == 200
