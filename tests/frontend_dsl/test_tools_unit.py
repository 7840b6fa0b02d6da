"""Tool calling in the DSL against the recording fake: schemas, the constraint sent, parsing,
running the call and continuing."""

from __future__ import annotations

import enum
import json
import re
from typing import Literal

import jsonschema
import pytest
from outlines_core.json_schema import build_regex_from_schema

import frontend_dsl as sgl
from frontend_dsl.tools import as_tools, parse_tool_call, tool_call_schema


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.C, days: int | None = None) -> str:
    """Current weather of a city.

    Args:
        city: the city's name
        unit (Unit): celsius or fahrenheit
    """
    return f"sunny in {city}"


def add(a: int, b: float, tags: list[str], mode: Literal["exact", "round"] = "exact") -> float:
    """Add two numbers."""
    return a + b


ADD_DICT = {"type": "function", "function": {
    "name": "lookup", "description": "Find a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}


def test_schema_from_a_function_signature_and_docstring() -> None:
    (weather,) = as_tools([get_weather])
    assert (weather.name, weather.description) == ("get_weather", "Current weather of a city.")
    assert weather.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"enum": ["celsius", "fahrenheit"], "description": "celsius or fahrenheit"},
            "days": {"type": "integer"},
        },
        "required": ["city"], "additionalProperties": False,
    }
    (adder,) = as_tools([add])
    props = adder.parameters["properties"]
    assert props["b"] == {"type": "number"} and props["mode"] == {"enum": ["exact", "round"]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert adder.parameters["required"] == ["a", "b", "tags"]


def test_dict_tools_pass_through_and_bad_tools_raise() -> None:
    (lookup,) = as_tools([ADD_DICT])
    assert lookup.func is None and lookup.parameters == ADD_DICT["function"]["parameters"]
    assert lookup.to_openai() == ADD_DICT

    def star(*args: int) -> None: ...

    def odd(x: set) -> None: ...

    for bad in ([], [add, add], [star], [odd], [{"type": "function"}], ["add"],
                [{"type": "function", "function": {"name": "has space"}}]):
        with pytest.raises(ValueError):
            as_tools(bad)


def test_the_call_schema_is_an_any_of_that_compiles_to_a_regex() -> None:
    tools = as_tools([get_weather, ADD_DICT])
    schema = tool_call_schema(tools)
    assert [b["properties"]["name"] for b in schema["anyOf"]] == [
        {"enum": ["get_weather"]}, {"enum": ["lookup"]}]
    regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    good = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}'
    assert re.fullmatch(regex, good)
    jsonschema.validate(json.loads(good), schema)
    wrong_args = '{"name":"lookup","arguments":{"city":"Oslo"}}'
    assert not re.fullmatch(regex, wrong_args)
    assert "anyOf" not in tool_call_schema(as_tools([add]))  # one tool: its branch alone


def test_gen_with_tools_sends_the_schema_and_the_call_runs(fake) -> None:
    reply = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'

    @sgl.function
    def agent(s):
        s += sgl.user("Weather in Oslo?")
        s += sgl.assistant(sgl.gen("call", tools=[get_weather, add], max_tokens=40))
        s["result"] = sgl.call_tool(s, "call")
        s += sgl.user("Tool said: " + s["result"])
        s += sgl.assistant(sgl.gen("answer", max_tokens=5))

    backend = fake(reply=lambda p, sp: reply if "json_schema" in sp else "ok")
    state = agent.run(backend=backend)
    body = backend.generate_bodies[0]["sampling_params"]
    assert json.loads(body["json_schema"]) == tool_call_schema(as_tools([get_weather, add]))
    assert state.tool_call("call") == ("get_weather", {"city": "Oslo"})
    assert state.tool_call("call").name == "get_weather"
    assert state["result"] == "sunny in Oslo"
    assert "Tool said: sunny in Oslo" in backend.generate_bodies[1]["text"]
    assert state["answer"] == "ok"


@pytest.mark.parametrize(("text", "message"), [
    ('{"name": "get_weather", "argum', "not complete JSON"),
    ('{"name": "nope", "arguments": {}}', "not one of the tools"),
    ('["get_weather"]', "a tool call is"),
    (['{"name": "get_weather", "arguments": {}}'], "text of one gen"),
])
def test_bad_calls_are_value_errors(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tool_call(text, as_tools([get_weather]))


def test_call_tool_needs_a_function(fake) -> None:
    @sgl.function
    def agent(s):
        s += sgl.gen("call", tools=[ADD_DICT], max_tokens=20)

    backend = fake(reply=lambda p, sp: '{"name": "lookup", "arguments": {"word": "x"}}')
    state = agent.run(backend=backend)
    with pytest.raises(ValueError, match="no Python function"):
        sgl.call_tool(state, "call")

    def lookup(word: str) -> str:
        return word.upper()

    assert sgl.call_tool(state, "call", tools=[lookup]) == "X"


def test_gen_tools_argument_errors() -> None:
    with pytest.raises(ValueError, match="variable name"):
        sgl.gen(tools=[add])
    with pytest.raises(ValueError, match="drop regex"):
        sgl.gen("c", tools=[add], regex="x")
