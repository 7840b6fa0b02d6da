"""OpenAI tool calling through the official `openai` client against a real server on the
default model: each tool_choice, streamed calls, a call -> result -> answer round trip,
sampled calls that always validate, pydantic tools, and the 400s."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# One earlier call -> result -> answer: the 135M default model follows the pattern (a model
# this small rarely calls a tool from the instructions alone).
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"},
]


@pytest.fixture(scope="module")
def client(real_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="default", tools=TOOLS, **kwargs)


def _check_calls(message: Any) -> list[tuple[str, dict]]:
    """Every call has an id, a known name and arguments that validate; (name, args) list."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return out


def test_required_named_auto_none(client: openai.OpenAI) -> None:
    required = _chat(client, tool_choice="required", max_tokens=64).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    assert _check_calls(required.message)[0][0] in SCHEMAS

    named = _chat(client, tool_choice={"type": "function", "function": {"name": "add"}},
                  max_tokens=64).choices[0]
    assert named.finish_reason == "tool_calls"
    assert [name for name, _ in _check_calls(named.message)] == ["add"]

    single = _chat(client, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=64).choices[0]
    assert len(_check_calls(single.message)) == 1

    called = _chat(client, messages=HISTORY, max_tokens=64).choices[0]  # tool_choice auto
    assert called.finish_reason == "tool_calls"
    assert _check_calls(called.message) == [("get_weather", {"city": "Rome"})]

    talked = _chat(client, tool_choice="auto", max_tokens=24).choices[0]
    assert talked.message.tool_calls is None and talked.message.content
    assert talked.finish_reason in ("stop", "length")

    # "none" with the same history: the model is not shown the tools and may not call one
    plain = _chat(client, messages=HISTORY, tool_choice="none", max_tokens=24).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str, dict[int, dict], str]:
    content, calls, reason = "", {}, ""
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                if part.id:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry["id"] = part.id
                if part.function and part.function.name:
                    entry["name"] += part.function.name
                if part.function and part.function.arguments:
                    entry["arguments"] += part.function.arguments
            reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("kwargs", [
    {"messages": HISTORY},
    {"tool_choice": {"type": "function", "function": {"name": "add"}}},
    {"tool_choice": "required"},
], ids=["auto", "named", "required"])
def test_streamed_calls_equal_the_whole_answer(client: openai.OpenAI, kwargs: dict) -> None:
    whole = _chat(client, max_tokens=64, **kwargs).choices[0]
    content, calls, reason = _stream(client, max_tokens=64, **kwargs)
    assert reason == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    expected = [(c.function.name, json.loads(c.function.arguments))
                for c in whole.message.tool_calls]
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert got == expected
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_round_trip_call_result_answer(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    first = _chat(client, messages=messages,
                  tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=48)
    message = first.choices[0].message
    (name, args), = _check_calls(message)
    messages.append(message.model_dump(exclude_none=True))  # content None, tool_calls kept
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                     "content": json.dumps({"result": args["a"] + args["b"]})})
    final = _chat(client, messages=messages, tool_choice="none", max_tokens=24).choices[0]
    assert final.message.tool_calls is None and final.message.content
    assert final.finish_reason in ("stop", "length")


def test_twenty_sampled_required_calls_all_validate(client: openai.OpenAI) -> None:
    found = []
    for seed in (1, 2):
        response = _chat(client, tool_choice="required", temperature=1.0, n=10, seed=seed,
                         max_tokens=96)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls", choice
            found += _check_calls(choice.message)
    assert len(found) >= 20


def test_pydantic_function_tool_parses(client: openai.OpenAI) -> None:
    class Booking(pydantic.BaseModel):
        city: str
        nights: int

    tool = openai.pydantic_function_tool(Booking, name="book_hotel")
    done = client.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Book 2 nights in Lisbon."}],
        tools=[tool], tool_choice={"type": "function", "function": {"name": "book_hotel"}},
        temperature=0, max_tokens=48,
    )
    call = done.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Booking)


@pytest.mark.parametrize("kwargs,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "not in tools"),
    ({"tools": [{"type": "retrieval"}]}, "only"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, kwargs: dict, needle: str) -> None:
    body = {"model": "default", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **kwargs}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(**body)


def test_react_agent_example(real_server: Any) -> None:
    """examples/openai_tool_agent.py: the model calls a tool, gets the result, answers."""
    import pathlib
    import subprocess
    import sys

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    out = subprocess.run(
        [sys.executable, str(examples / "openai_tool_agent.py"), "--url", real_server.url],
        capture_output=True, text=True, timeout=240, cwd=examples,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    calls = [line for line in lines if line.startswith("tool call: ")]
    assert calls and calls[0].startswith('tool call: capital_of({"country": "Japan"}) -> '), lines
    assert "'Tokyo'" in calls[0]
    answers = [line for line in lines if line.startswith("final answer: ")]
    assert len(answers) == 1 and len(answers[0]) > len("final answer: "), lines
