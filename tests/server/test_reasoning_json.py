"""Structured output that reasons first, through the official `openai` client on a real server.

The model is a tiny seeded Qwen3 (benchmarks/tiny_families) whose chat template thinks as
Qwen3's does: the model writes `<think>` itself, `enable_thinking: false` writes an empty block
into the prompt; `think_in_prompt` opens the block in the prompt, as DeepSeek-R1's and
Qwen3-Thinking's templates do. A random model never closes its block by itself, so the thinking
budget (the grammar's) closes it. Sampled answers (temperature 1, n > 1, several seeds) must
parse and validate against the schema after the block, while the block holds free text.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest

from benchmarks.tiny_families import Family, build_folder, default_tokenizer_json
from sglang_like.server.errors import ApiError
from sglang_like.server.openai.reasoning import ReasoningPlan
from sglang_like.server.openai.reasoning_grammar import answer_format, think_then_answer
from sglang_like.server.openai.reasoning_parser import get_reasoning_format

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}{% endif %}"
)
# small on purpose: a random model fills every string to its bound; the patterns also keep
# raw control characters out (xgrammar's JSON strings admit them; json.loads does not)
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "sunny": {"type": "boolean"},
    "size": {"enum": ["S", "M", "L"]},
    "days": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city", "sunny", "size", "days"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Weather in Rome as JSON, please."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["city"], "additionalProperties": False}}}
BUDGET = 6
MAX_TOKENS = 64  # the budget's block, its end marker and the answer fit with room to spare


@pytest.fixture(scope="module")
def client(module_server_launcher: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> openai.OpenAI:
    folder: Path = tmp_path_factory.mktemp("thinking-qwen3")
    build_folder(Family("qwen3", "qwen3", {}), folder, default_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    server = module_server_launcher("--model-path", str(folder), "--reasoning-parser", "qwen3",
                                    "--max-running-requests", "8")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="default", temperature=1.0, extra_body=extra,
                                          **kwargs)


def _reasoning(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _stream(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any
            ) -> list[tuple[str, str, str]]:
    """(reasoning, content, finish_reason) of each choice of a streamed answer."""
    out: dict[int, list[str]] = {}
    for chunk in _chat(client, extra, stream=True, **kwargs):
        for choice in chunk.choices:
            parts = out.setdefault(choice.index, ["", "", ""])
            parts[0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            parts[1] += choice.delta.content or ""
            parts[2] = choice.finish_reason or parts[2]
    return [tuple(out[i]) for i in sorted(out)]  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [{}, {"think_in_prompt": True}],
                         ids=["model-writes-think", "prompt-opens-think"])
def test_sampled_answers_after_free_thinking_hold_the_schema(client: openai.OpenAI,
                                                             kwargs: dict[str, Any]) -> None:
    extra = {"thinking_budget": BUDGET, "chat_template_kwargs": kwargs}
    answers: list[tuple[str | None, str | None]] = []
    for seed in (1, 2):
        response = _chat(client, {**extra, "seed": seed}, n=3, response_format=RESPONSE_FORMAT)
        answers += [(_reasoning(c.message), c.message.content) for c in response.choices]
        assert {c.finish_reason for c in response.choices} == {"stop"}
    answers += [(r, c) for r, c, reason in _stream(client, {**extra, "seed": 3}, n=2,
                                                   response_format=RESPONSE_FORMAT)]
    for reasoning, content in answers:
        assert reasoning is not None and content is not None
        jsonschema.validate(json.loads(content), SCHEMA)
    # the block is free text: the random model's words are not JSON
    assert any(r.strip() and not _parses(r) for r, _ in answers)
    assert len({r for r, _ in answers}) > 1 and len({c for _, c in answers}) > 1
    # no budget: the block stays open as long as the model thinks (the schema waits)
    choice = _chat(client, {"chat_template_kwargs": kwargs, "seed": 4}, max_tokens=8,
                   response_format=RESPONSE_FORMAT).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert _reasoning(choice.message)


def test_the_budget_closes_the_block_in_the_grammar(client: openai.OpenAI) -> None:
    raw = _chat(client, {"thinking_budget": 0, "separate_reasoning": False, "seed": 4},
                response_format=RESPONSE_FORMAT).choices[0].message.content
    assert raw.startswith("<think></think>")
    jsonschema.validate(json.loads(raw.removeprefix("<think></think>")), SCHEMA)
    choice = _chat(client, {"thinking_budget": BUDGET, "seed": 5}, logprobs=True,
                   response_format=RESPONSE_FORMAT).choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    # `<think>`, at most BUDGET tokens of thought, `</think>`, the answer: one request, every
    # token the model's own, sampled under the mask
    assert all(t.logprob > float("-inf") for t in choice.logprobs.content)
    ends = [len("".join(tokens[:n + 1])) for n in range(len(tokens))]  # text end per token
    text = "".join(tokens)
    num_head = next(n for n, end in enumerate(ends) if end >= len("<think>")) + 1
    first_of_end = next(n for n, end in enumerate(ends) if end > text.index("</think>"))
    assert text.startswith("<think>") and first_of_end - num_head <= BUDGET
    assert _reasoning(choice.message)
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_thinking_off_holds_the_answer_from_its_first_token(client: openai.OpenAI) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    response = _chat(client, {**off, "seed": 6}, n=2, response_format=RESPONSE_FORMAT)
    for choice in response.choices:
        assert _reasoning(choice.message) is None
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    json_object = _chat(client, {**off, "seed": 7}, response_format={"type": "json_object"})
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"])
def test_tool_calls_after_the_think_block_parse(client: openai.OpenAI,
                                                tool_choice: Any) -> None:
    extra = {"thinking_budget": BUDGET, "seed": 8}
    # one call: a random model would fill a list of parallel calls up to max_tokens
    tools = {"tools": [WEATHER], "tool_choice": tool_choice, "parallel_tool_calls": False}
    response = _chat(client, extra, n=2, **tools)
    streamed = _chat(client, extra, n=2, stream=True, **tools)
    streamed_args: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                streamed_args[choice.index] = (streamed_args.get(choice.index, "")
                                               + (call.function.arguments or ""))
    for choice in response.choices:
        assert _reasoning(choice.message) and choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
    assert sorted(streamed_args) == [0, 1]
    for arguments in streamed_args.values():
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_what_one_grammar_cannot_hold_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="thinking_budget"):
        _chat(client, {"thinking_budget": 3, "regex": "[a-z]{3}"})
    with pytest.raises(openai.BadRequestError, match="json_schema is not valid JSON"):
        _chat(client, {"json_schema": "{not json"})


def test_grammar_shapes() -> None:
    """The tag for each start, and the answer formats read from sampling params."""
    qwen3, r1 = get_reasoning_format("qwen3"), get_reasoning_format("deepseek-r1")
    answer = answer_format({"json_object": True})
    assert answer == {"type": "json_schema", "json_schema": {"type": "object"},
                      "max_whitespace_cnt": 1}
    writes = think_then_answer(qwen3, False, answer, None)["format"]["elements"][0]
    assert (writes["begin"], writes["end"], writes["content"]) == (
        "<think>", "</think>", {"type": "any_text"})
    inside = think_then_answer(r1, True, answer, 5)["format"]["elements"][0]
    assert (inside["begin"], inside["content"]) == ("", {"type": "any_text", "max_tokens": 5})
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"],
                                                "tags": []}}
    assert answer_format({"structural_tag": json.dumps(tag)}) == tag["format"]
    assert answer_format({"regex": "x"}) is None


@pytest.mark.parametrize(("parser", "prompt", "begin"), [
    ("qwen3", "<|im_start|>assistant\n", "<think>"),  # the model writes the block
    ("qwen3", "<|im_start|>assistant\n<think>\n", ""),  # the template opened it
    ("deepseek-r1", "<|im_start|>assistant\n", ""),  # the format always starts inside
    ("deepseek-r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # thinking off
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),
])
def test_plan_by_template_variant(parser: str, prompt: str, begin: str | None) -> None:
    req = SimpleNamespace(thinking_budget=4, separate_reasoning=True, stream_reasoning=True)
    plan = ReasoningPlan.build(parser, None, req, prompt)
    constrained, sampling = plan.constrain({"json_object": True, "max_new_tokens": 9},
                                           "xgrammar")
    assert constrained.budget is None and sampling["max_new_tokens"] == 9
    if begin is None:  # the answer is held from its first token, and read as the answer
        assert sampling["json_object"] and "structural_tag" not in sampling
        assert plan.split('{"a": 1}') == (None, '{"a": 1}')
        return
    (think, answer) = sampling["structural_tag"]["format"]["elements"]
    assert "json_object" not in sampling and answer["json_schema"] == {"type": "object"}
    assert (think["begin"], think["content"]["max_tokens"]) == (begin, 4)
    with pytest.raises(ApiError, match="grammar-backend xgrammar"):
        plan.constrain({"json_object": True}, "outlines")
    assert plan.constrain({"max_new_tokens": 9}, "xgrammar") == (plan, {"max_new_tokens": 9})


def test_special_token_markers_are_refused_under_a_schema() -> None:
    req = SimpleNamespace(thinking_budget=None, separate_reasoning=True, stream_reasoning=True)
    plan = ReasoningPlan.build("mistral", None, req, "[INST]hi[/INST]")
    with pytest.raises(ApiError, match="special tokens"):
        plan.constrain({"json_schema": {"type": "object"}}, "xgrammar")
