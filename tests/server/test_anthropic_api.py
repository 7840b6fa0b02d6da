"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client, unchanged,
against the real server on the default model: whole and streamed answers agree at temperature
0, usage equals the tokenizer's counts, stop reasons, a tool-use round trip, the 400s for what
the server does not serve; and `x-api-key` over the fake engine."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from sglang_like.model_loader import load_tokenizer

SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# The current SDK has no sampling arguments; the API (and older SDKs) take them in the body.
GREEDY = {"temperature": 0}
ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# One earlier call -> result -> answer, in Anthropic's blocks: the 135M default model follows
# the pattern (a model this small rarely calls a tool from the instructions alone).
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_0", "content": "18 C, sunny"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 18 C and sunny in Paris."}]},
    {"role": "user", "content": "What is the weather in Rome?"},
]


@pytest.fixture(scope="module")
def client(real_server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


def _prompt_len(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(prompt))


@pytest.mark.slow
def test_whole_and_streamed_answers_agree(client: anthropic.Anthropic, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": "default", "max_tokens": 48, "system": SYSTEM,
                              "messages": ASK, "extra_body": GREEDY}
    # the first run caches the prompt: the runs compared below take the same path (by default
    # greedy output may differ between a cold and a cached prefix; README, --enable-deterministic)
    client.messages.create(**kwargs)
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == "SmolLM2-135M-Instruct"  # the served model's name
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    text = whole.content[0].text
    num_prompt = _prompt_len(tokenizer, [{"role": "system", "content": SYSTEM}, *ASK])
    assert whole.usage.input_tokens == num_prompt
    # the answer's tokens and the end-of-turn token the model stopped on
    assert whole.usage.output_tokens == len(tokenizer.encode(text)) + 1
    counted = client.messages.count_tokens(model="default", system=SYSTEM, messages=ASK)
    assert counted.input_tokens == num_prompt

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)

    events = [e.type for e in client.messages.create(stream=True, **kwargs)]
    num_deltas = events.count("content_block_delta")
    assert events == ["message_start", "content_block_start", *["content_block_delta"] * num_deltas,
                      "content_block_stop", "message_delta", "message_stop"] and num_deltas > 0

    # a stop sequence taken from the answer itself: the text ends before it
    word = " " + text.split()[2]
    cut = client.messages.create(**kwargs, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]
    short = client.messages.create(**{**kwargs, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert text.startswith(short.content[0].text)


@pytest.mark.slow
def test_multi_turn_with_blocks(client: anthropic.Anthropic, tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "My name is Ada. "},
                                     {"type": "text", "text": "Remember it."}]},
        {"role": "assistant", "content": "I will remember that your name is Ada."},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?",
                                      "cache_control": {"type": "ephemeral"}}]},
    ]
    system = [{"type": "text", "text": "You are a helpful assistant."}]
    answer = client.messages.create(model="default", max_tokens=24, system=system,
                                    messages=messages, extra_body=GREEDY)
    flat = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "My name is Ada. Remember it."},
            {"role": "assistant", "content": "I will remember that your name is Ada."},
            {"role": "user", "content": "What is my name?"}]
    assert answer.usage.input_tokens == _prompt_len(tokenizer, flat)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def _tool_uses(message: Any) -> list[tuple[str, dict]]:
    uses = [b for b in message.content if b.type == "tool_use"]
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, {"add": ADD, "get_weather": WEATHER}[use.name][
            "input_schema"])
    return [(u.name, u.input) for u in uses]


@pytest.mark.slow
def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    kwargs: dict[str, Any] = {"model": "default", "max_tokens": 48, "tools": [ADD],
                              "extra_body": GREEDY}
    first = client.messages.create(messages=messages, tool_choice={"type": "tool", "name": "add"},
                                   **kwargs)
    assert first.stop_reason == "tool_use"
    (name, args), = _tool_uses(first)
    assert name == "add"
    use = first.content[-1]
    messages.append({"role": "assistant", "content": first.content})  # the SDK's blocks, as-is
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(
            {"result": args["a"] + args["b"]})}]})
    final = client.messages.create(messages=messages, tool_choice={"type": "none"},
                                   **{**kwargs, "max_tokens": 16})
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"},
                                    {"type": "tool", "name": "get_weather"}],
                         ids=["auto", "any", "tool"])
def test_streamed_tool_use_equals_the_whole_answer(client: anthropic.Anthropic,
                                                   choice: dict) -> None:
    kwargs: dict[str, Any] = {"model": "default", "max_tokens": 64, "tools": [WEATHER, ADD],
                              "tool_choice": choice, "messages": HISTORY, "extra_body": GREEDY}
    client.messages.create(**kwargs)  # caches the prompt (see the first test)
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    calls = _tool_uses(whole)
    assert calls[0] == ("get_weather", {"city": "Rome"})
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in events and final.stop_reason == "tool_use"
    assert _tool_uses(final) == calls
    assert [b.type for b in final.content] == [b.type for b in whole.content]


@pytest.mark.slow
def test_structured_output(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    answer = client.messages.create(
        model="default", max_tokens=32, messages=ASK, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(answer.content[0].text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("extra,needle", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "not supported by this server: "
                                                                "thinking"),
    ({"metadata": {"user_id": "u1"}}, "metadata"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}, "reads text only"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "mul"}}, "not in tools"),
    ({"tools": [ADD], "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"max_tokens": 20_000}, "context length"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
], ids=["thinking", "metadata", "image", "server-tool", "temperature", "unknown-tool",
        "unnamed-tool", "max-tokens", "effort"])
def test_unserved_fields_are_400(client: anthropic.Anthropic, extra: dict, needle: str) -> None:
    kwargs: dict[str, Any] = {"model": "default", "max_tokens": 8, "messages": ASK, **extra}
    with pytest.raises(anthropic.BadRequestError, match=needle) as caught:
        client.messages.create(**kwargs)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_error_shapes(client: anthropic.Anthropic, real_server: Any) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="SmolLM2-135M-Instruct:nope", max_tokens=8, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    # max_tokens is required, as Anthropic requires it (the SDK always sends it)
    r = httpx.post(real_server.url + "/v1/messages", json={"model": "m", "messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_x_api_key(fake_server_factory: Any) -> None:
    """Anthropic's key header is a key like Bearer's; Authorization, when sent, decides."""
    server = fake_server_factory(api_key="sekrit")
    url, body = server.url + "/v1/messages", {"model": "m", "max_tokens": 3, "messages": ASK}
    ok = httpx.post(url, json=body, headers={"x-api-key": "sekrit"})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3
    for headers in ({}, {"x-api-key": "wrong"},
                    {"x-api-key": "sekrit", "Authorization": "Bearer wrong"}):
        assert httpx.post(url, json=body, headers=headers).status_code == 401, headers
    sdk = anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)
    answer = sdk.messages.create(**body)
    assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 3
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            **body)
