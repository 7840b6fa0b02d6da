"""Reasoning models through the official `openai` client against a real server on loopback.

The default model does not think, so the server here runs `--reasoning-parser deepseek-r1`
(the answer starts inside the think block: text before `</think>` is reasoning), and the
model's output is pushed through `</think>` by the project's own constrained decoding (the
`regex` extra field) or by the thinking budget. The split is checked against the raw text the
same request gives with separate_reasoning=false; streamed against non-streamed at
temperature 0. The 400s of a server without a parser use the shared default server.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from sglang_like.server.errors import ApiError
from sglang_like.server.openai.reasoning import check_template_kwargs

pytestmark = pytest.mark.slow

END = "</think>"
ASK = [{"role": "user", "content": "What is two plus two?"}]
THINK_THEN_ANSWER = r"[a-z ]{4,30}</think>[A-Za-z ,.]{4,30}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(module_server_launcher: Any) -> openai.OpenAI:
    server = module_server_launcher("--reasoning-parser", "deepseek-r1",
                                    "--max-running-requests", "8")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def _chat(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(model="default", temperature=0, extra_body=extra,
                                          **kwargs)


def _stream(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any
            ) -> tuple[str, str, str, list[str]]:
    """(reasoning, content, finish_reason, kinds of the deltas in order) of a streamed answer."""
    reasoning, content, reason, kinds = "", "", "", []
    for chunk in _chat(client, extra, stream=True, **kwargs):
        for choice in chunk.choices:
            if piece := _extra(choice.delta, "reasoning_content"):
                reasoning += piece
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
            reason = choice.finish_reason or reason
    return reasoning, content, reason, kinds


def test_split_equals_the_raw_text_streamed_or_not(client: openai.OpenAI) -> None:
    raw = _chat(client, {"regex": THINK_THEN_ANSWER, "separate_reasoning": False},
                max_tokens=64).choices[0].message
    assert _extra(raw, "reasoning_content") is None and END in raw.content
    thought, _, answer = raw.content.partition(END)

    whole = _chat(client, {"regex": THINK_THEN_ANSWER}, max_tokens=64).choices[0]
    assert (_extra(whole.message, "reasoning_content"), whole.message.content) == (
        thought, answer)

    reasoning, content, reason, kinds = _stream(client, {"regex": THINK_THEN_ANSWER},
                                                max_tokens=64)
    assert (reasoning, content, reason) == (thought, answer, whole.finish_reason)
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta before any content
    # stream_reasoning=false: the same text, the reasoning in one delta
    held = _stream(client, {"regex": THINK_THEN_ANSWER, "stream_reasoning": False},
                   max_tokens=64)
    assert held[:2] == (thought, answer) and held[3].count("reasoning") == 1


def test_unclosed_block_is_all_reasoning(client: openai.OpenAI) -> None:
    choice = _chat(client, {}, max_tokens=8).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    raw = _chat(client, {"separate_reasoning": False}, max_tokens=8).choices[0].message.content
    assert _extra(choice.message, "reasoning_content") == raw


@pytest.mark.parametrize("budget", [0, 5])
def test_thinking_budget_closes_the_block_in_time(client: openai.OpenAI, budget: int) -> None:
    extra = {"thinking_budget": budget}
    choice = _chat(client, extra, max_tokens=20, logprobs=True).choices[0]
    reasoning = _extra(choice.message, "reasoning_content")
    tokens = choice.logprobs.content
    # the first `budget` tokens are the reasoning, then the server's </think> (logprob 0)
    assert "".join(t.token for t in tokens[:budget]) == reasoning
    num_end = next(n for n in range(1, len(tokens)) if
                   "".join(t.token for t in tokens[budget:budget + n]) == END)
    assert all(t.logprob == 0.0 for t in tokens[budget:budget + num_end])
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    # the answer's tokens; stopped by the end-of-turn token, its entry closes the list (no
    # stop strings here), and its text is not content
    stopped = choice.finish_reason == "stop"
    assert not stopped or tokens[-1].token == "<|im_end|>"
    answer = tokens[budget + num_end:len(tokens) - stopped]
    assert "".join(t.token for t in answer) == choice.message.content

    raw = _chat(client, {**extra, "separate_reasoning": False}, max_tokens=20)
    assert raw.choices[0].message.content == reasoning + END + choice.message.content
    assert raw.usage.completion_tokens == len(tokens) <= 20

    streamed = _stream(client, extra, max_tokens=20)
    assert streamed[:3] == (reasoning, choice.message.content, choice.finish_reason)
    # a budget past max_tokens changes nothing: the block stays open
    late = _chat(client, {"thinking_budget": 50}, max_tokens=8).choices[0]
    assert late.message.content is None and _extra(late.message, "reasoning_content")


def test_tool_calls_are_read_from_the_content_only(client: openai.OpenAI) -> None:
    regex = r"[a-z ]{4,30}</think>" + _escape(CALL)
    choice = _chat(client, {"regex": regex}, max_tokens=80, tools=[WEATHER]).choices[0]
    assert _extra(choice.message, "reasoning_content")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Rome"})
    # a call written inside the block is reasoning, not a call
    inside = r"<tool_call>[a-z ]{4,20}</think>[A-Za-z ]{4,20}"
    choice = _chat(client, {"regex": inside}, max_tokens=64, tools=[WEATHER]).choices[0]
    assert choice.message.tool_calls is None
    assert _extra(choice.message, "reasoning_content").startswith("<tool_call>")


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$*+?{}[]|()" else c for c in text)


@pytest.mark.parametrize(("extra", "field"), [
    ({"thinking_budget": 10}, "thinking_budget"),
    ({"stream_reasoning": False}, "stream_reasoning"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
])
def test_400_for_reasoning_fields_without_a_parser(real_server: Any, extra: dict,
                                                   field: str) -> None:
    plain = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(plain, extra, max_tokens=4)
    assert field in str(e.value)
    # what sglang-router sends on every body is taken
    ok = _chat(plain, {"separate_reasoning": True, "stream_reasoning": True}, max_tokens=4)
    assert ok.choices[0].message.content is not None


def test_budget_under_a_constraint_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="thinking_budget"):
        _chat(client, {"thinking_budget": 3, "regex": THINK_THEN_ANSWER}, max_tokens=8)


def test_template_kwargs_must_be_read_by_the_template() -> None:
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}"
                "<think>\n\n</think>\n\n{% endif %}")
    assert check_template_kwargs({"enable_thinking": False}, template) == {
        "enable_thinking": False}
    for bad in ({"thinking": True}, {"messages": []}):
        with pytest.raises(ApiError, match="chat_template_kwargs"):
            check_template_kwargs(bad, template)
