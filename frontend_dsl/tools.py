"""Tool calling in programs: `gen(name, tools=[...])` writes one call, `call_tool` runs it.

A tool is a Python function or an OpenAI-style dict
`{"type": "function", "function": {"name", "description", "parameters"}}`. For a function, the
JSON schema of its arguments comes from its signature:

    str -> string, int -> integer, float -> number, bool -> boolean, list[X] -> array of X,
    dict -> object, Literal["a", "b"] -> enum, an Enum subclass -> enum of its values,
    X | None -> X; a parameter with no annotation is a string. A parameter with a default is
    optional; *args / **kwargs are not allowed. The description is the docstring's first
    paragraph; a Google-style "Args:" section (`name: text` lines) describes the parameters.

`gen(name, tools=tools)` constrains the model to one JSON object
`{"name": <a tool's name>, "arguments": <that tool's arguments>}` (an anyOf over the tools,
sent as the json_schema constraint) and stores the raw text under `name`:

    s += sgl.assistant(sgl.gen("call", tools=[get_weather], max_tokens=64))
    call = s.tool_call("call")          # ToolCall(name="get_weather", arguments={...})
    result = sgl.call_tool(s, "call")   # get_weather(**call.arguments)
    s += sgl.user(f"The tool returned {result}.")

The prompt is the program's: `describe_tools(tools)` renders the tools as text to put in it.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Tool:
    """One tool: its name, description, arguments schema and (for a function) the function."""

    name: str
    description: str
    parameters: dict[str, Any]
    func: Callable[..., Any] | None = field(default=None, compare=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolCall(NamedTuple):
    """A parsed tool call: `tool_name, arguments = s.tool_call("call")` works too."""

    name: str
    arguments: dict[str, Any]


def as_tools(tools: Any) -> list[Tool]:
    """Normalise a list of functions / OpenAI tool dicts / Tools; names must be unique."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError("tools must be a non-empty list of functions or tool dicts")
    out = [t if isinstance(t, Tool) else _from_dict(t) if isinstance(t, dict)
           else _from_function(t) for t in tools]
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return out


def tool_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools`."""
    branches = [{
        "type": "object",
        "properties": {"name": {"enum": [t.name]}, "arguments": t.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def parse_tool_call(text: str, tools: list[Tool] | None = None) -> ToolCall:
    """Parse the text a tools= gen wrote; with `tools`, the name must be one of them."""
    if not isinstance(text, str):  # e.g. the list a fork's join gathered
        raise ValueError(f"a tool call is the text of one gen, got {type(text).__name__}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call is not complete JSON ({e}; raise max_tokens?): "
                         f"{text!r}") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(
            obj.get("arguments"), dict):
        raise ValueError(f'a tool call is {{"name": ..., "arguments": {{...}}}}, got {text!r}')
    if tools is not None and obj["name"] not in {t.name for t in tools}:
        raise ValueError(f"the model called {obj['name']!r}, not one of the tools")
    return ToolCall(obj["name"], obj["arguments"])


def describe_tools(tools: Any) -> str:
    """The tools as prompt text: one line per tool with its arguments schema."""
    lines = ['You can call one tool. Answer with JSON {"name": ..., "arguments": {...}}.',
             "Tools:"]
    for t in as_tools(tools):
        lines.append(f"- {t.name}: {t.description} Arguments: {json.dumps(t.parameters)}")
    return "\n".join(lines)


def call_tool(state: Any, name: str, tools: Any = None) -> Any:
    """Run the call stored in variable `name` with the matching Python function.

    `tools` defaults to the ones given to that gen; a dict tool has no function to run, so
    pass functions (or Tools with `func`) here for those.
    """
    call = state.tool_call(name)
    known = as_tools(tools) if tools is not None else state.stream_executor.tools_by_var.get(
        name) or []
    tool = next((t for t in known if t.name == call.name), None)
    if tool is None or tool.func is None:
        raise ValueError(f"no Python function for tool {call.name!r}; pass tools=[...]")
    return tool.func(**call.arguments)


# ---- schemas ----------------------------------------------------------------------------------
def _from_dict(spec: dict[str, Any]) -> Tool:
    fn = spec.get("function", spec) if spec.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f'a tool dict is {{"type": "function", "function": {{"name": ...}}}}, '
                         f"got {spec!r}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValueError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
    return Tool(_check_name(fn["name"]), str(fn.get("description") or ""), params)


def _from_function(func: Any) -> Tool:
    if not callable(func):
        raise ValueError(f"a tool is a function or a tool dict, got {type(func).__name__}")
    name = _check_name(getattr(func, "__name__", ""))
    summary, arg_docs = _parse_docstring(inspect.getdoc(func) or "")
    hints = typing.get_type_hints(func)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(func).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *args / **kwargs have no JSON schema")
        schema = _json_schema(hints.get(p.name, str), f"{name}({p.name})")
        if p.name in arg_docs:
            schema = {**schema, "description": arg_docs[p.name]}
        properties[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    params = {"type": "object", "properties": properties, "required": required,
              "additionalProperties": False}
    return Tool(name, summary, params, func)


def _json_schema(hint: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_schema(rest[0], where)
        return {"anyOf": [_json_schema(a, where) for a in rest]}
    if hint is list or origin is list:
        return {"type": "array", **({"items": _json_schema(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    raise ValueError(f"tool {where}: no JSON schema for type {hint!r}")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    arg_docs: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            indented = line.startswith((" ", "\t"))
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", stripped)
            if m and indented:
                arg_docs[m.group(1)] = m.group(2)
            elif not indented:  # a blank or unindented line ends the section
                in_args = False
    return summary, arg_docs


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"tool name {name!r} must match {_NAME.pattern}")
    return name
