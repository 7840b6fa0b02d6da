"""logit_bias through the real server: the official openai client's `logit_bias` on chat and
completions, and SGLang's sampling parameter on /generate; bad values are 400s."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def _token_id(url: str, text: str) -> int:
    return httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"][-1]


def test_openai_client_logit_bias(real_server: Any) -> None:
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", timeout=120)
    forced = _token_id(real_server.url, " banana")
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=3,
        temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 3
    plain = client.completions.create(model="m", prompt="Name a colour:", max_tokens=4,
                                      temperature=0)
    first = httpx.post(real_server.url + "/generate", timeout=120, json={
        "text": "Name a colour:", "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }).json()["output_ids"][0]  # the token the completion starts with
    banned = client.completions.create(model="m", prompt="Name a colour:", max_tokens=4,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    for bad in ({"abc": 1}, {str(forced): 101}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model="m", prompt="x", max_tokens=1, logit_bias=bad)


def test_native_generate_logit_bias(real_server: Any) -> None:
    forced = _token_id(real_server.url, " banana")
    r = httpx.post(real_server.url + "/generate", timeout=120, json={
        "text": "Fruit:", "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                              "logit_bias": {str(forced): 100}}})
    assert r.status_code == 200 and r.json()["output_ids"] == [forced, forced]
    bad = httpx.post(real_server.url + "/generate", json={
        "text": "x", "sampling_params": {"logit_bias": {"x": 1}}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]
