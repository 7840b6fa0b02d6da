"""Tool-call formats of model families: how a model writes a call, how we read it back (whole
or streamed), how a call is written into the history, and the grammar that keeps `auto` calls
well-formed.

A parser only knows where a call starts (`starts`) and how to read one complete call region;
`ToolCallStream` does the rest, so a streamed answer and a whole one are read identically.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sglang_like.function_call.tools import Tool, ToolCall, dump_arguments

_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` (after whitespace) and where it ends; None while it is
    still being written (or is no JSON)."""
    try:
        return _DECODER.raw_decode(text, _skip_space(text, pos))
    except ValueError:
        return None


class ToolCallParser:
    """The base: subclasses set `name`, `starts` and implement `read_region`."""

    name = ""
    # Text that opens a call region (the first one found in the output wins).
    starts: tuple[str, ...] = ()
    # The format's opening marker is a special token, so the text must keep special tokens.
    needs_special_tokens = False

    def read_region(
        self, text: str, tools: list[Tool], final: bool
    ) -> tuple[list[ToolCall] | None, int] | None:
        """Read the call region at the start of `text` (which begins with one of `starts`).

        None: the region is not complete yet. Else (calls, end): the region is text[:end];
        calls is None when it is complete but not a valid call (it is then kept as content).
        `final`: no more text will come.
        """
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """Assistant-message text for OpenAI tool_calls, for templates with no tool syntax."""
        raise NotImplementedError

    def instructions(self, tools: list[Tool]) -> str:
        """A system-prompt section that lists the tools and shows this format."""
        raise NotImplementedError

    def structural_tag(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        """xgrammar's structural tag for `auto`: free text, and each call, once begun, is held
        to its tool's schema. None when the format cannot be expressed (special-token marker)."""
        return None

    def parse(self, text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; content is None when only calls remain."""
        stream = ToolCallStream(self, tools)
        pieces, calls = [], []
        for kind, value in [*stream.feed(text), *stream.finish()]:
            if kind == "content":
                pieces.append(value)
            else:
                calls.append(value)
        content = "".join(pieces).strip()
        return (content or None), calls


def _call_from(obj: Any, tools: list[Tool]) -> ToolCall | None:
    """A call from {"name", "arguments" | "parameters"} (either key: formats differ)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict) or not any(t.name == name for t in tools):
        return None
    return ToolCall(name, dump_arguments(arguments))


def _calls_from(value: Any, tools: list[Tool]) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(item, tools) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _call_json(call: dict[str, Any], args_key: str) -> str:
    fn = call.get("function") or {}
    arguments = fn.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return json.dumps({"name": fn.get("name"), args_key: arguments}, ensure_ascii=False)


def _tool_list_json(tools: list[Tool]) -> str:
    return "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_call(body: str, tools: list[Tool]) -> list[ToolCall] | None:
    """Qwen3-Coder / Qwen3.5's call inside <tool_call>: `<function=NAME>` holding one
    `<parameter=KEY>\nVALUE\n</parameter>` per argument. Values are bare text: a string
    parameter keeps it, others read it as JSON (number, bool, object, ...)."""
    match = _XML_FUNCTION.fullmatch(body)
    if match is None:
        return None
    tool = next((t for t in tools if t.name == match.group(1)), None)
    if tool is None:
        return None
    properties = tool.parameters.get("properties") or {}
    arguments: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(match.group(2)):
        value: Any = raw
        if (properties.get(key) or {}).get("type") != "string":
            try:
                value = json.loads(raw)
            except ValueError:
                pass
        arguments[key] = value
    return [ToolCall(tool.name, dump_arguments(arguments))]


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag per call (Hermes,
    Qwen2.5/Qwen3, Granite 4; a JSON list inside one tag is read too, as SmolLM2's tool data
    writes it; Qwen3-Coder / Qwen3.5's `<function=...>` body inside the same tags too)."""

    name = "hermes"
    starts = ("<tool_call>",)
    _END = "</tool_call>"

    def read_region(
        self, text: str, tools: list[Tool], final: bool
    ) -> tuple[list[ToolCall] | None, int] | None:
        end = text.find(self._END)
        if end < 0:
            return None
        body = text[len(self.starts[0]):end].strip()
        if body.startswith("<function="):
            return _xml_call(body, tools), end + len(self._END)
        try:
            value = json.loads(body)
        except ValueError:
            return None, end + len(self._END)
        return _calls_from(value, tools), end + len(self._END)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{_call_json(c, 'arguments')}\n</tool_call>" for c in calls)

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "You can call functions to help with the user's request. The functions are listed "
            "as JSON inside <tools></tools>:\n<tools>\n" + _tool_list_json(tools) + "\n</tools>\n"
            "To call a function, answer with one JSON object per call inside "
            "<tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
            "Function results come back inside <tool_response></tool_response> tags."
        )

    def structural_tag(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        tags = [
            {"type": "tag",
             "begin": f'<tool_call>\n{{"name": {json.dumps(t.name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t.parameters},
             "end": "}\n</tool_call>"}
            for t in tools
        ]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel,
        }}


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+'s JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several joined by `;`."""

    name = "llama3"
    starts = ("<|python_tag|>", '{"name"')
    _SEP = re.compile(r"\s*;\s*")

    def read_region(
        self, text: str, tools: list[Tool], final: bool
    ) -> tuple[list[ToolCall] | None, int] | None:
        pos = len(self.starts[0]) if text.startswith(self.starts[0]) else 0
        calls: list[ToolCall] = []
        while True:
            read = _json_at(text, pos)
            if read is None:
                return None  # the object is still being written
            value, pos = read
            found = _calls_from(value, tools)
            if found is None:
                return None, pos
            calls.extend(found)
            sep = self._SEP.match(text, pos)
            at_end = sep.end() == len(text) if sep is not None else not text[pos:].strip()
            if at_end and not final:
                return None  # a ';' and another call may still follow
            if sep is None or at_end:
                return calls, pos
            pos = sep.end()

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_call_json(c, "parameters") for c in calls)

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "You have access to the following functions:\n" + _tool_list_json(tools) + "\n"
            "To call a function, respond with only a JSON object of the form "
            '{"name": "<function name>", "parameters": {<arguments as JSON>}}.'
        )

    def structural_tag(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        tags = [
            {"type": "tag", "begin": f'{{"name": {json.dumps(t.name)}, "parameters": ',
             "content": {"type": "json_schema", "json_schema": t.parameters}, "end": "}"}
            for t in tools
        ]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ['{"name": '], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel,
        }}


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Nemo) and the newer
    `[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, one marker per
    call (Mistral Small 3.2, Ministral 3, Devstral). [TOOL_CALLS] is a special token: the
    answer is detokenized with special tokens kept."""

    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    _ARGS = "[ARGS]"
    _CALL_ID = "[CALL_ID]"

    def read_region(
        self, text: str, tools: list[Tool], final: bool
    ) -> tuple[list[ToolCall] | None, int] | None:
        pos = _skip_space(text, len(self.starts[0]))
        if pos < len(text) and text[pos] not in "[{":
            return self._read_named(text, pos, tools)
        read = _json_at(text, pos)
        if read is None:
            return None
        return _calls_from(read[0], tools), read[1]

    def _read_named(
        self, text: str, pos: int, tools: list[Tool]
    ) -> tuple[list[ToolCall] | None, int] | None:
        args_at = text.find(self._ARGS, pos)
        if args_at < 0:
            return None  # the name (and call id) is still being written
        name = text[pos:args_at].split(self._CALL_ID, 1)[0].strip()
        read = _json_at(text, args_at + len(self._ARGS))
        if read is None:
            return None
        arguments, end = read
        call = _call_from({"name": name, "arguments": arguments}, tools)
        return (None if call is None else [call]), end

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "[TOOL_CALLS] [" + ", ".join(_call_json(c, "arguments") for c in calls) + "]"

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "[AVAILABLE_TOOLS] [" + ", ".join(json.dumps(t.to_openai()) for t in tools)
            + "] [/AVAILABLE_TOOLS] To call tools, answer [TOOL_CALLS] followed by a JSON list of "
            '{"name": ..., "arguments": {...}} objects.'
        )


class GraniteParser(ToolCallParser):
    """Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (the marker is a
    special token: the answer is detokenized with special tokens kept)."""

    name = "granite"
    starts = ("<|tool_call|>",)
    needs_special_tokens = True

    def read_region(
        self, text: str, tools: list[Tool], final: bool
    ) -> tuple[list[ToolCall] | None, int] | None:
        read = _json_at(text, len(self.starts[0]))
        if read is None:
            return None
        return _calls_from(read[0], tools), read[1]

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "<|tool_call|>[" + ", ".join(_call_json(c, "arguments") for c in calls) + "]"

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "You can use these tools:\n" + _tool_list_json(tools) + "\nTo use tools, answer "
            '<|tool_call|> followed by a JSON list of {"name": ..., "arguments": {...}} objects.'
        )


PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser)
}
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", *PARSERS)


def get_parser(name: str, chat_template: str | None = None) -> ToolCallParser:
    """The parser called `name`; "auto" picks by the chat template's own tool syntax, and
    Hermes-style `<tool_call>` tags when the template has none (the default model's case)."""
    if name == "auto":
        template = chat_template or ""
        if "[TOOL_CALLS]" in template:
            name = "mistral"
        elif "<tool_call>" in template:  # Hermes-3 on Llama 3.1 writes Hermes tags
            name = "hermes"
        elif "<|tool_call|>" in template:
            name = "granite"
        elif "<|python_tag|>" in template or "<|eom_id|>" in template or (
            # Llama 3.2 has neither marker; it writes {"name": ..., "parameters": ...}
            "<|start_header_id|>" in template and '"parameters"' in template
        ):
            name = "llama3"
        else:
            name = "hermes"
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")
    return PARSERS[name]()


@dataclass
class ToolCallStream:
    """Reads an answer as it streams: content is passed on as soon as it cannot be the start of
    a call; each call is handed out once its region is complete. `feed` and `finish` return
    events ("content", str) and ("call", ToolCall)."""

    parser: ToolCallParser
    tools: list[Tool]
    _pending: str = ""  # text not yet handed out
    num_calls: int = 0

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self._pending += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        events = self._drain(final=True)
        if self._pending:
            events.append(self._content(self._pending))
            self._pending = ""
        return [e for e in events if e[1] != ""]

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while self._pending:
            start = self._find_start(self._pending)
            if start is None:
                keep = 0 if final else self._partial_start_len(self._pending)
                cut = len(self._pending) - keep
                if cut:
                    events.append(self._content(self._pending[:cut]))
                    self._pending = self._pending[cut:]
                break
            if start:
                events.append(self._content(self._pending[:start]))
                self._pending = self._pending[start:]
            read = self.parser.read_region(self._pending, self.tools, final)
            if read is None:
                break  # the call is still being written (finish() keeps it as content)
            calls, end = read
            region, self._pending = self._pending[:end], self._pending[end:]
            if calls is None:
                events.append(self._content(region))
                continue
            self.num_calls += len(calls)
            events.extend(("call", call) for call in calls)
        return [e for e in events if e[1] != ""]

    def _content(self, text: str) -> tuple[str, str]:
        # whitespace between calls is layout, not an answer
        return ("content", "" if self.num_calls and not text.strip() else text)

    def _find_start(self, text: str) -> int | None:
        found = [i for s in self.parser.starts if (i := text.find(s)) >= 0]
        return min(found) if found else None

    def _partial_start_len(self, text: str) -> int:
        """The longest suffix of `text` that is a proper prefix of a start marker."""
        best = 0
        for marker in self.parser.starts:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    best = max(best, n)
                    break
        return best
