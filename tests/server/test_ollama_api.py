"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/version) through the
official `ollama` client, unchanged, against the real server on the default model: streamed
NDJSON and whole answers agree at temperature 0, counts equal the tokenizer's, `context`
continues a conversation, options and `format` act, tools round-trip, and what the server
does not serve is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from sglang_like.model_loader import load_tokenizer

pytestmark = pytest.mark.slow

ASK = [{"role": "system", "content": "You are terse."},
       {"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
JSON_ASK = [{"role": "user", "content": 'Return JSON: {"city": <the capital of France>}'}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# One earlier call -> result -> answer: the 135M default model follows the pattern.
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"},
]


@pytest.fixture(scope="module")
def client(real_server: Any) -> ollama.Client:
    return ollama.Client(host=real_server.url)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def model_name(real_server: Any) -> str:
    return httpx.get(real_server.url + "/v1/models").json()["data"][0]["id"]


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_list_show_version(client: ollama.Client, real_server: Any, model_name: str) -> None:
    (listed,) = client.list().models
    assert listed.model == model_name + ":latest" and listed.size > 0
    assert listed.details.format == "gguf"
    info = httpx.get(real_server.url + "/get_model_info").json()
    for name in (listed.model, model_name):
        shown = client.show(name)
        assert shown.template == info["chat_template"]
        arch = shown.modelinfo["general.architecture"]
        assert shown.modelinfo[f"{arch}.context_length"] == info["context_length"]
        assert "completion" in shown.capabilities
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("llama3.2:latest")
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    version = httpx.get(real_server.url + "/api/version").json()["version"]
    assert version == httpx.get(real_server.url + "/openapi.json").json()["info"]["version"]


def test_chat_streamed_and_whole_agree(client: ollama.Client, tokenizer: Any,
                                       model_name: str) -> None:
    kwargs: dict[str, Any] = {"model": model_name + ":latest", "messages": ASK,
                              "options": {**GREEDY, "num_predict": 48}}
    # the first run caches the prompt: the runs compared below take the same path
    client.chat(**kwargs)
    whole = client.chat(**kwargs)
    assert whole.done and whole.done_reason == "stop" and whole.message.role == "assistant"
    assert whole.model == model_name + ":latest"
    text = whole.message.content
    assert text and whole.prompt_eval_count == len(_template_ids(tokenizer, ASK))
    assert whole.eval_count == len(tokenizer.encode(text)) + 1  # and the end-of-turn token
    parts = list(client.chat(stream=True, **kwargs))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and len(parts) > 2
    assert "".join(p.message.content for p in parts) == text
    last = parts[-1]
    assert (last.done_reason, last.prompt_eval_count, last.eval_count) == (
        "stop", whole.prompt_eval_count, whole.eval_count)
    assert 0 < last.prompt_eval_duration < last.total_duration
    assert 0 < last.eval_duration < last.total_duration

    # options: num_predict, and a stop string taken from the answer itself
    short = client.chat(**{**kwargs, "options": {**GREEDY, "num_predict": 3}})
    assert short.done_reason == "length" and short.eval_count == 3
    assert text.startswith(short.message.content)
    word = " " + text.split()[2]
    cut = client.chat(**{**kwargs, "options": {**GREEDY, "num_predict": 48, "stop": [word]}})
    assert cut.message.content == text[: text.index(word)]


def test_generate_streamed_whole_raw_and_context(client: ollama.Client, tokenizer: Any,
                                                 real_server: Any) -> None:
    prompt = "Name a primary color."
    kwargs: dict[str, Any] = {"model": "any-name", "prompt": prompt,
                              "options": {**GREEDY, "num_predict": 24}}
    client.generate(**kwargs)
    whole = client.generate(**kwargs)
    ids = _template_ids(tokenizer, [{"role": "user", "content": prompt}])
    assert whole.prompt_eval_count == len(ids) and whole.response
    assert whole.context[: len(ids)] == ids
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    parts = list(client.generate(stream=True, **kwargs))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].context == whole.context

    # `context` carries the conversation: the next prompt is appended to it
    follow = client.generate(**{**kwargs, "prompt": "Another one?", "context": whole.context,
                                "options": {**GREEDY, "num_predict": 4}})
    more = _template_ids(tokenizer, [{"role": "user", "content": "Another one?"}])
    assert follow.prompt_eval_count == len(whole.context) + len(more)

    # raw: the prompt as it is, no template; the same greedy text as the native /generate
    text = "The capital of France is"
    native = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    httpx.post(real_server.url + "/generate", json=native, timeout=60)
    expected = httpx.post(real_server.url + "/generate", json=native, timeout=60).json()
    raw = client.generate(model="m", prompt=text, raw=True,
                          options={**GREEDY, "num_predict": 8})
    assert raw.prompt_eval_count == len(tokenizer.encode(text))
    assert raw.response == expected["text"]


def test_format_json_and_schema(client: ollama.Client) -> None:
    for stream in (False, True):
        answer = client.chat(model="m", messages=JSON_ASK, format="json", stream=stream,
                             options={**GREEDY, "num_predict": 96})
        content = answer.message.content if not stream else "".join(
            p.message.content for p in answer)
        assert isinstance(json.loads(content), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
              "required": ["city"], "additionalProperties": False}
    answer = client.generate(model="m", prompt=JSON_ASK[0]["content"], format=schema,
                             options={"num_predict": 64, "seed": 3})
    jsonschema.validate(json.loads(answer.response), schema)


def test_tool_call_round_trip(client: ollama.Client) -> None:
    kwargs: dict[str, Any] = {"model": "m", "tools": [WEATHER], "messages": HISTORY,
                              "options": {**GREEDY, "num_predict": 64}}
    client.chat(**kwargs)  # caches the prompt (see above)
    whole = client.chat(**kwargs)
    calls = [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Rome"})]
    parts = list(client.chat(stream=True, **kwargs))
    streamed = [(c.function.name, dict(c.function.arguments))
                for p in parts for c in p.message.tool_calls or []]
    assert streamed == calls
    messages = [*HISTORY, whole.message,
                {"role": "tool", "content": "25 C, cloudy", "tool_name": "get_weather"}]
    final = client.chat(**{**kwargs, "messages": messages,
                           "options": {**GREEDY, "num_predict": 16}})
    assert final.message.content and not final.message.tool_calls


def test_load_requests(client: ollama.Client) -> None:
    """No messages / no prompt: Ollama's way to load a model; it is loaded already."""
    assert client.chat(model="m", messages=[]).done_reason == "load"
    assert client.generate(model="m").done_reason == "load"


@pytest.mark.parametrize("kwargs,field", [
    ({"images": [b"\x89PNG"]}, "images"),
    ({"keep_alive": "5m"}, "keep_alive"),
    ({"options": {"num_ctx": 4096}}, "options.num_ctx"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"think": True}, "think"),
    ({"template": "{{ .Prompt }}"}, "template"),
    ({"suffix": "return x"}, "suffix"),
    ({"logprobs": True}, "logprobs"),
    ({"width": 64}, "width"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unserved_fields_are_400(client: ollama.Client, kwargs: dict, field: str) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="m", prompt="Hi", **kwargs)
    assert caught.value.status_code == 400 and field in caught.value.error


def test_error_shape_and_forever_keep_alive(client: ollama.Client, real_server: Any) -> None:
    r = httpx.post(real_server.url + "/api/chat", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert "messages[0].images" in r.json()["error"]
    ok = client.generate(model="m", prompt="Hi", keep_alive=-1, options={"num_predict": 1})
    assert ok.done and ok.eval_count == 1
