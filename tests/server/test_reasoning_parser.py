"""The reasoning parsers (sglang_like.server.openai.reasoning_parser) on whole answers and on
the same answers streamed in every split into two and three chunks: the streamed events joined
equal the whole split, and the whole split equals a reference written with plain string
operations."""

from __future__ import annotations

import itertools

import pytest

from sglang_like.config import REASONING_PARSERS
from sglang_like.server.openai.reasoning_parser import (
    ReasoningReader,
    get_reasoning_format,
    opens_in_prompt,
)

ANSWERS = [
    "<think>a < b, so 2</think>The answer is 2.",
    "\n<think>\nhmm </thin k>\n</think>\n\nYes.",
    "<think>cut short by max_tokens",
    "<think></think>",
    "No block, just < an answer </think>",
    "Thinking first</think>then the answer",
    "<thi",
    "   ",
    "",
    "<think>x</think>y</think>z",
]


def _reference(text: str, start: str, end: str, inside: bool) -> tuple[str | None, str]:
    """How an answer splits: a block only at its start (after whitespace), or from the first
    character when the answer starts inside one; the first end marker closes it."""
    body = text.lstrip()
    if body.startswith(start):
        text, inside = body[len(start):], True
    if not inside:
        return None, text
    reasoning, sep, content = text.partition(end)
    return reasoning, content


def _streamed(reader: ReasoningReader, pieces: list[str]) -> tuple[str, str, int]:
    events = [e for p in pieces for e in reader.feed(p)] + reader.finish()
    reasoning = "".join(t for kind, t in events if kind == "reasoning")
    content = "".join(t for kind, t in events if kind == "content")
    return reasoning, content, sum(kind == "reasoning" for kind, _ in events)


def _splits(text: str) -> list[list[str]]:
    """The text cut at every boundary into two pieces and at every pair into three."""
    out = [[text]]
    for i in range(len(text) + 1):
        out.append([text[:i], text[i:]])
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        out.append([text[:i], text[i:j], text[j:]])
    return out


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1", "mistral"])
@pytest.mark.parametrize("answer", ANSWERS)
def test_streamed_equals_whole_at_every_boundary(name: str, answer: str) -> None:
    fmt = get_reasoning_format(name)
    text = answer.replace("<think>", fmt.start).replace("</think>", fmt.end)
    inside = fmt.starts_inside
    reasoning, content = ReasoningReader(fmt, inside).split(text)
    assert (reasoning, content) == _reference(text, fmt.start, fmt.end, inside)
    for pieces in _splits(text):
        got = _streamed(ReasoningReader(fmt, inside), pieces)[:2]
        assert got == (reasoning or "", content), pieces
        # stream_reasoning=False: the same text, the reasoning in at most one event
        held = _streamed(ReasoningReader(fmt, inside, stream_reasoning=False), pieces)
        assert held[:2] == (reasoning or "", content) and held[2] <= 1, pieces


def test_markers_never_leak_and_nothing_is_held_back_needlessly() -> None:
    fmt = get_reasoning_format("qwen3")
    reader = ReasoningReader(fmt)
    assert reader.feed("<thi") == []  # may still be the start marker
    assert reader.feed("nk>ab</th") == [("reasoning", "ab")]  # "</th" may be the end marker
    assert reader.is_thinking
    assert reader.feed("ink>") == []
    assert not reader.is_thinking
    assert reader.feed("ok") == [("content", "ok")]
    plain = ReasoningReader(fmt)
    assert plain.feed("Sure") == [("content", "Sure")]  # cannot become <think>: sent at once


@pytest.mark.parametrize(("prompt", "opens"), [
    ("<|im_start|>assistant\n", False),
    ("<|im_start|>assistant\n<think>\n", True),  # a template that opens the block
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking=false
    ("<think>old</think><|im_start|>assistant\n<think>\n", True),
])
def test_prompt_that_opens_the_block(prompt: str, opens: bool) -> None:
    assert opens_in_prompt(get_reasoning_format("qwen3"), prompt) is opens
    assert opens_in_prompt(get_reasoning_format("deepseek-r1"), prompt)  # always inside


def test_names_and_unknown() -> None:
    assert {"qwen3", "deepseek-r1", "smollm3", "qwen3-thinking"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_format("nope")
