"""gen(tools=...) on the default model, in-process and over HTTP: the call is valid JSON for
one of the tools, it runs, and the program continues with its result."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

import frontend_dsl as sgl
from frontend_dsl.tools import as_tools, tool_call_schema

pytestmark = pytest.mark.slow


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def get_time(city: str) -> str:
    """The local time in a city."""
    return f"12:00 in {city}"


@sgl.function
def agent(s, question):
    s += sgl.system(sgl.describe_tools([add, get_time]))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("call", tools=[add, get_time], max_tokens=48, temperature=0))
    s["result"] = sgl.call_tool(s, "call")
    s += sgl.user(f"The tool returned {s['result']}. Answer in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


@pytest.fixture(scope="module", params=["in-process", "http"])
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "in-process":
        b = sgl.Runtime(engine=request.getfixturevalue("engine"))
    else:
        b = sgl.RuntimeEndpoint(request.getfixturevalue("server_url"))
    yield b
    b.shutdown()


def test_tool_call_runs_and_the_program_continues(backend) -> None:
    state = agent.run(question="What is 17 plus 25?", backend=backend)
    call = state.tool_call("call")
    schema = tool_call_schema(as_tools([add, get_time]))
    jsonschema.validate(json.loads(state["call"]), schema)  # the constraint held
    assert call.name in ("add", "get_time")
    expected = add(**call.arguments) if call.name == "add" else get_time(**call.arguments)
    assert state["result"] == expected
    assert f"The tool returned {expected}." in state.text()
    assert state.messages()[-1]["role"] == "assistant"
    assert state.get_meta_info("answer")["prompt_tokens"] > state.get_meta_info("call")[
        "prompt_tokens"]
