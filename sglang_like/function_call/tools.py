"""OpenAI tool definitions and tool_choice, checked; the calls a model made; the constraints
that make `required` and named-function calls always parse.

Everything here raises ValueError with a message naming the bad field; the HTTP edge turns it
into a 400.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["none", "auto", "required", "named"]

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and the JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_EMPTY_PARAMETERS))

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
        }}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: no calls, the model's choice, at least one call, or one named
    function (`tool`)."""

    mode: ToolMode
    tool: Tool | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(tools: list[Any] | None) -> list[Tool]:
    """Check OpenAI's `tools` list ({"type": "function", "function": {...}}) into Tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of tool objects")
    out: list[Tool] = []
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ValueError(f'{where}: only {{"type": "function", "function": {{...}}}} tools '
                             "are supported")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, _ . : or -, "
                             f"got {name!r}")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object")
        if any(t.name == name for t in out):
            raise ValueError(f"{where}: two tools are named {name!r}")
        out.append(Tool(name, description, parameters))
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice`: "none" | "auto" | "required" | {"type": "function",
    "function": {"name": ...}}; unset means "auto" with tools and "none" without."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named '
                             f"function, got {choice!r}")
        if choice != "none" and not tools:
            raise ValueError(f'tool_choice "{choice}" needs tools')
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        for tool in tools:
            if tool.name == name:
                return ToolChoice("named", tool)
        known = ", ".join(t.name for t in tools) or "none"
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                         f"(tools: {known})")
    raise ValueError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def required_calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON Schema of `required`'s output: a list of {"name", "arguments"} objects, each
    naming one tool and holding arguments valid for it; one item unless `parallel`."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_object_schema(t) for t in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_object_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.name]},
                       "arguments": tool.parameters},
        "required": ["name", "arguments"],
    }


def parse_required_calls(text: str, tools: list[Tool]) -> list[ToolCall] | None:
    """The calls in a `required` answer (JSON list), or None when the text is not one (it was
    cut by max_tokens or a stop string)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    names = {t.name for t in tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments")
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], dump_arguments(arguments)))
    return calls


def dump_arguments(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False)
