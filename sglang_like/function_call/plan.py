"""ToolPlan: what one chat request with `tools` does differently, from prompt to answer.

- The prompt: templates that know tools get `tools=` and the messages as Hugging Face expects
  them (arguments as objects); templates that do not (the default model's ChatML) get the
  tools described in the system message in the parser's format, past calls written in that
  format, and tool results as user turns.
- The constraint: a named function's arguments are generated under its parameters' schema;
  `required` under a schema of a non-empty list of calls; `auto` (xgrammar) under a structural
  tag that leaves text free and holds each call, once begun, to its tool's schema.
- The answer: read back into content and calls, whole or as stream deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sglang_like.function_call.parsers import ToolCallParser, ToolCallStream, get_parser
from sglang_like.function_call.tools import (
    Tool,
    ToolCall,
    ToolChoice,
    new_call_id,
    parse_required_calls,
    parse_tool_choice,
    parse_tools,
    required_calls_schema,
)

_CONSTRAINT_KEYS = ("regex", "json_schema", "json_object", "ebnf", "structural_tag")


@dataclass
class ToolPlan:
    tools: list[Tool]
    choice: ToolChoice
    parser: ToolCallParser
    parallel: bool = True
    template_knows_tools: bool = False
    constrain_auto: bool = True

    @classmethod
    def build(
        cls, tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
        parser: str, chat_template: str | None, grammar_backend: str,
    ) -> ToolPlan | None:
        """The plan of a request, or None when it offers no tools (ValueError on bad input)."""
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed)
        if not parsed:
            return None
        return cls(
            parsed, choice, get_parser(parser, chat_template),
            parallel=parallel_tool_calls is not False,
            template_knows_tools="tools" in (chat_template or ""),
            constrain_auto=grammar_backend == "xgrammar",
        )

    @property
    def offers_tools(self) -> bool:
        return self.choice.mode != "none"

    # ---- prompt ---------------------------------------------------------------------------
    def template_inputs(
        self, messages: list[dict[str, Any]], tool_role: bool = True
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. With tool_choice "none" the tools are not
        shown to the model at all.

        For a template with no tool syntax, tool results stay `tool` turns when `tool_role`
        (ChatML renders any role, and the default model follows a call -> tool -> answer
        history far better so); else they become user turns in <tool_response> tags, for
        templates that allow user and assistant turns only.
        """
        offered = self.tools if self.offers_tools else []
        if self.template_knows_tools:
            return [_hf_message(m) for m in messages], [t.to_openai() for t in offered] or None
        out: list[dict[str, Any]] = []
        for message in messages:
            role = message["role"]
            if role == "assistant" and message.get("tool_calls"):
                text = message.get("content") or ""
                calls = self.parser.render_calls(message["tool_calls"])
                out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
            elif role == "tool" and tool_role:
                out.append({"role": "tool", "content": message.get("content") or ""})
            elif role == "tool":
                result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
                if out and out[-1].get("is_tool_result"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result, "is_tool_result": True})
            else:
                out.append({k: v for k, v in message.items()
                            if k not in ("tool_calls", "tool_call_id")})
        for message in out:
            message.pop("is_tool_result", None)
        if offered:
            instructions = self.parser.instructions(offered)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
            else:
                out.insert(0, {"role": "system", "content": instructions})
        return out, None

    # ---- constraint -----------------------------------------------------------------------
    def sampling_params(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """`sampling` with this plan's constraint added (ValueError when the request has its
        own constraint and tool_choice needs one)."""
        own = [k for k in _CONSTRAINT_KEYS if sampling.get(k) not in (None, False)]
        mode = self.choice.mode
        out = dict(sampling)
        if mode in ("required", "named") and own:
            raise ValueError(f"tool_choice {self._choice_text()} cannot be combined with "
                             f"{own[0]} / response_format")
        if mode == "named":
            assert self.choice.tool is not None
            out["json_schema"] = self.choice.tool.parameters
        elif mode == "required":
            out["json_schema"] = required_calls_schema(self.tools, self.parallel)
        elif mode == "auto":
            tag = self.parser.structural_tag(self.tools, self.parallel)
            if tag is not None and self.constrain_auto and not own:
                out["structural_tag"] = tag
            if self.parser.needs_special_tokens:
                out["skip_special_tokens"] = False
        return out

    def _choice_text(self) -> str:
        if self.choice.mode == "named":
            assert self.choice.tool is not None
            return f"naming {self.choice.tool.name!r}"
        return f'"{self.choice.mode}"'

    # ---- answer ---------------------------------------------------------------------------
    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer. An answer that is not a complete call (cut by
        max_tokens or a stop string) is returned as content with no calls."""
        mode = self.choice.mode
        if mode == "named":
            assert self.choice.tool is not None
            return (None, [ToolCall(self.choice.tool.name, text)]) if _is_object(text) else (
                text, [])
        if mode == "required":
            calls = parse_required_calls(text, self.tools)
            return (None, calls) if calls else (text, [])
        if mode == "auto":
            return self.parser.parse(text, self.tools)
        return text, []

    def stream(self) -> ChatToolStream:
        return ChatToolStream(self)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _hf_message(message: dict[str, Any]) -> dict[str, Any]:
    """Tool calls as Hugging Face templates read them: arguments as an object, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        out["tool_calls"].append({**call, "function": fn})
    return out


@dataclass
class ChatToolStream:
    """Chat-chunk deltas for a streamed answer under a ToolPlan: {"content": ...} and
    {"tool_calls": [...]} in OpenAI's streaming shape (the first delta of a call has its id,
    type and name; a named function's arguments stream as they are generated; other calls are
    sent whole once complete)."""

    plan: ToolPlan
    num_calls: int = 0
    _text: str = ""
    _named_id: str = field(default_factory=new_call_id)
    _reader: ToolCallStream | None = None

    def __post_init__(self) -> None:
        if self.plan.choice.mode == "auto":
            self._reader = ToolCallStream(self.plan.parser, self.plan.tools)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        mode = self.plan.choice.mode
        if mode == "named":
            return self._named(delta)
        if mode == "required":
            self._text += delta
            return []
        if self._reader is not None:
            return self._events(self._reader.feed(delta))
        return [{"content": delta}] if delta else []

    def finish(self) -> list[dict[str, Any]]:
        mode = self.plan.choice.mode
        if mode == "required":
            calls = parse_required_calls(self._text, self.plan.tools)
            if calls is None:
                return [{"content": self._text}] if self._text else []
            return [self._call_delta(call) for call in calls]
        if self._reader is not None:
            return self._events(self._reader.finish())
        return []

    def _named(self, delta: str) -> list[dict[str, Any]]:
        assert self.plan.choice.tool is not None
        out = []
        if self.num_calls == 0:
            self.num_calls = 1
            out.append({"tool_calls": [{
                "index": 0, "id": self._named_id, "type": "function",
                "function": {"name": self.plan.choice.tool.name, "arguments": ""},
            }]})
        if delta:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out

    def _events(self, events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        return [{"content": value} if kind == "content" else self._call_delta(value)
                for kind, value in events]

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        return {"tool_calls": [{"index": index, **call.to_openai()}]}
