"""The tool-call layer on its own: tool checks, each family's format read whole and streamed
(split at every character), the constraint each tool_choice asks for, and the prompt for a
template with no tool syntax. The real model and the official client are in
tests/server/test_tool_calling.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sglang_like.function_call import ToolCallStream, ToolPlan, get_parser
from sglang_like.function_call.tools import (
    parse_required_calls,
    parse_tool_choice,
    parse_tools,
    required_calls_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = parse_tools([WEATHER, ADD])
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
          "{% endfor %}")


def _streamed(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` one character at a time; (content, [(name, arguments)])."""
    stream = ToolCallStream(get_parser(parser_name), TOOLS)
    events = []
    for ch in text:
        events += stream.feed(ch)
    events += stream.finish()
    content = "".join(v for k, v in events if k == "content")
    return content, [(v.name, v.arguments) for k, v in events if k == "call"]


@pytest.mark.parametrize("parser_name,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
               '\n</tool_call>', "Let me check.", [("get_weather", '{"city": "Rome"}')]),
    ("hermes", '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather",'
               ' "arguments": {"city": "Oslo"}}]</tool_call>', None,
     [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo"}')]),
    ("hermes", "no calls here, just <tool_ text", "no calls here, just <tool_ text", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> after',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> after', []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1', '<tool_call>\n{"name": "add",'
               ' "arguments": {"a": 1', []),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; '
               '{"name": "get_weather", "parameters": {"city": "Lima"}}', None,
     [("add", '{"a": 3, "b": 4}'), ("get_weather", '{"city": "Lima"}')]),
    ("llama3", 'Sure: {"name": "add", "parameters": {"a": 3, "b": 4}}', "Sure:",
     [("add", '{"a": 3, "b": 4}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}]', None,
     [("add", '{"a": 5, "b": 6}')]),
    # Mistral Small 3.2 / Ministral 3 / Devstral: one [TOOL_CALLS]name[(CALL_ID]id)[ARGS]{...}
    ("mistral", 'On it.[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]get_weather[CALL_ID]'
                'abc123XYZ[ARGS]{"city": "Kyiv"}', "On it.",
     [("add", '{"a": 5, "b": 6}'), ("get_weather", '{"city": "Kyiv"}')]),
    ("mistral", "[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
    # Qwen3-Coder / Qwen3.5: XML-ish body in the Hermes tags; non-string values read as JSON
    ("hermes", "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n-2"
               "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
               "<parameter=city>\n1984\n</parameter>\n</function>\n</tool_call>", None,
     [("add", '{"a": 7, "b": -2}'), ("get_weather", '{"city": "1984"}')]),
    ("granite", 'Checking.<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Lund"}}]', "Checking.",
     [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Lund"}')]),
    ("hermes", "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
     "<tool_call>\n<function=nope>\n</function>\n</tool_call>", []),
])
def test_parsers_read_whole_and_streamed_alike(
    parser_name: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    whole_content, whole_calls = get_parser(parser_name).parse(text, TOOLS)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    assert all(c.id.startswith("call_") for c in whole_calls)
    assert len({c.id for c in whole_calls}) == len(whole_calls)
    streamed_content, streamed_calls = _streamed(parser_name, text)
    assert (streamed_content.strip() or None) == content
    assert streamed_calls == calls


def test_stream_holds_back_a_partial_marker_then_releases_it() -> None:
    stream = ToolCallStream(get_parser("hermes"), TOOLS)
    assert stream.feed("Hello <tool") == [("content", "Hello ")]
    assert stream.feed("box> done") == [("content", "<toolbox> done")]
    assert stream.finish() == []


def test_render_calls_round_trips_through_the_parser() -> None:
    history = [{"id": "call_1", "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    for name in ("hermes", "llama3", "mistral", "granite"):
        parser = get_parser(name)
        _, calls = parser.parse(parser.render_calls(history), TOOLS)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_auto_parser_follows_the_template() -> None:
    assert get_parser("auto", CHATML).name == "hermes"
    assert get_parser("auto", None).name == "hermes"
    assert get_parser("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert get_parser("auto", "{{ '<|python_tag|>' }}").name == "llama3"
    # Llama 3.2 writes JSON calls with neither <|python_tag|> nor <|eom_id|> in its template
    llama32 = """<|start_header_id|>{{ '{"name": "' + c.name + '", "parameters": ' }}"""
    assert get_parser("auto", llama32).name == "llama3"
    # Hermes-3 on Llama 3.1: Hermes tags win over the Llama 3 markers
    assert get_parser("auto", "<|eom_id|><|start_header_id|><tool_call>").name == "hermes"
    assert get_parser("auto", "{{ ' <|tool_call|>' }}").name == "granite"  # Granite 3.x
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("pythonic")


@pytest.mark.parametrize("tools,message", [
    ([{"type": "code_interpreter"}], "only"),
    ([{"type": "function"}], "must be an object"),
    ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON Schema"),
    ([WEATHER, WEATHER], "two tools"),
    ("get_weather", "must be a list"),
])
def test_bad_tools_are_value_errors(tools: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)  # type: ignore[arg-type]


def test_tool_choice() -> None:
    assert parse_tool_choice(None, TOOLS).mode == "auto"
    assert parse_tool_choice(None, []).mode == "none"
    assert parse_tool_choice("none", []).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert named.mode == "named" and named.tool is not None and named.tool.name == "add"
    with pytest.raises(ValueError, match="not in tools"):
        parse_tool_choice({"type": "function", "function": {"name": "mul"}}, TOOLS)
    with pytest.raises(ValueError, match="needs tools"):
        parse_tool_choice("required", [])
    with pytest.raises(ValueError, match="tool_choice must be"):
        parse_tool_choice("sometimes", TOOLS)


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    schema = required_calls_schema(TOOLS, parallel=True)
    good = [{"name": "add", "arguments": {"a": 1, "b": 2}},
            {"name": "get_weather", "arguments": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "add", "arguments": {"a": "x", "b": 2}}],
                [{"name": "get_weather", "arguments": {}}], [{"name": "mul", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_calls_schema(TOOLS, parallel=False))
    calls = parse_required_calls(json.dumps(good), TOOLS)
    assert calls is not None and [c.name for c in calls] == ["add", "get_weather"]
    assert parse_required_calls('[{"name": "add", "argu', TOOLS) is None


def _plan(choice: object, parallel: bool | None = None, backend: str = "xgrammar") -> ToolPlan:
    plan = ToolPlan.build([WEATHER, ADD], choice, parallel, "auto", CHATML, backend)
    assert plan is not None
    return plan


def test_plan_constraints_per_tool_choice() -> None:
    base = {"max_new_tokens": 8}
    named = _plan({"type": "function", "function": {"name": "add"}}).sampling_params(base)
    assert named["json_schema"] == ADD["function"]["parameters"]
    required = _plan("required", parallel=False).sampling_params(base)
    assert required["json_schema"]["maxItems"] == 1
    auto = _plan("auto").sampling_params(base)
    tag = auto["structural_tag"]["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"]
    assert [t["begin"].split('"')[3] for t in tag["tags"]] == ["get_weather", "add"]
    assert "structural_tag" not in _plan("auto", backend="outlines").sampling_params(base)
    assert _plan("none").sampling_params(base) == base
    # the user's own constraint wins over auto's, and cannot be combined with a forced call
    own = {**base, "regex": "[ab]+"}
    assert _plan("auto").sampling_params(own) == own
    with pytest.raises(ValueError, match="cannot be combined"):
        _plan("required").sampling_params(own)
    assert ToolPlan.build(None, None, None, "auto", CHATML, "xgrammar") is None


def test_plan_prompt_for_a_template_without_tool_syntax() -> None:
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    ]
    turns, tools = _plan("auto").template_inputs(messages)
    assert tools is None
    assert turns[0]["role"] == "system" and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                        '"arguments": {"city": "Rome"}}\n</tool_call>'}
    assert turns[3] == {"role": "tool", "content": "20 C"}
    as_user, _ = _plan("auto").template_inputs(messages, tool_role=False)
    assert as_user[3] == {"role": "user", "content": "<tool_response>\n20 C\n</tool_response>"}
    hidden, _ = _plan("none").template_inputs(messages)
    assert hidden[0] == messages[0]  # no tool list shown when tool_choice is "none"


def test_plan_prompt_for_a_template_that_knows_tools() -> None:
    plan = ToolPlan.build([WEATHER], "auto", None, "hermes", "{% if tools %}{% endif %}",
                          "xgrammar")
    assert plan is not None
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Rome"}'}}]}]
    turns, tools = plan.template_inputs(messages)
    assert tools == [WEATHER | {"function": {**WEATHER["function"]}}]
    assert turns[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'


def test_named_stream_sends_arguments_as_they_come() -> None:
    stream = _plan({"type": "function", "function": {"name": "add"}}).stream()
    first = stream.feed('{"a": 1')
    head = first[0]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "add", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]}
    assert stream.feed(', "b": 2}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]}]
    assert stream.finish() == [] and stream.num_calls == 1
