"""Reasoning formats of model families: where a model's think block starts and ends, and how an
answer is split into reasoning and content, whole or as it streams (`--reasoning-parser`).

A format only names its markers and whether the output starts inside the block;
`ReasoningReader` does the rest, so a streamed answer and a whole one split identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_like.config import REASONING_PARSERS

__all__ = ["ReasoningFormat", "ReasoningReader", "closes_in_prompt", "get_reasoning_format",
           "opens_in_prompt"]


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's think block: `start` ... `end`, the answer after it."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # the template always opens the block in the prompt, so the output starts inside it even
    # when the prompt text does not show it (DeepSeek-R1: text before `end` is reasoning)
    starts_inside: bool = False
    # the markers are special tokens: the answer must be detokenized with them kept
    needs_special_tokens: bool = False


# SGLang's parser names for the families the model registry serves that think: Qwen3 (and its
# Thinking-2507 models, whose template opens <think>), DeepSeek-R1 and its Llama / Qwen
# distills, SmolLM3 (<think> as Qwen3 writes it), Magistral / Ministral reasoning ([THINK]).
_FORMATS = (
    ReasoningFormat("qwen3"),
    ReasoningFormat("qwen3-thinking", starts_inside=True),
    ReasoningFormat("deepseek-r1", starts_inside=True),
    ReasoningFormat("smollm3"),
    ReasoningFormat("mistral", start="[THINK]", end="[/THINK]", needs_special_tokens=True),
)
_BY_NAME = {f.name: f for f in _FORMATS}
assert tuple(_BY_NAME) == REASONING_PARSERS, "config.REASONING_PARSERS names these formats"


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format called `name` (ValueError naming the known ones otherwise)."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of "
                         f"{REASONING_PARSERS}")
    return _BY_NAME[name]


def opens_in_prompt(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the output starts inside the think block: the format says so, or the rendered
    prompt ends with the block open (a template that writes `<think>` after the assistant
    header; one that writes an empty block, as Qwen3's with enable_thinking=false, closes it)."""
    if fmt.starts_inside:
        return True
    opened = prompt.rfind(fmt.start)
    return opened >= 0 and prompt.rfind(fmt.end) < opened


def closes_in_prompt(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the rendered prompt ends with the block closed: thinking is off (Qwen3's and
    SmolLM3's templates write an empty block then), and the output is the answer."""
    return prompt.rstrip().endswith(fmt.end)


def _partial_suffix_len(text: str, marker: str) -> int:
    """The longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ReasoningReader:
    """Splits an answer into ("reasoning", text) and ("content", text) events as it streams.

    States: "head" (nothing decided: the answer may still open the block), "reasoning" (inside
    the block), "content" (after it, or no block). A block is recognized only at the start of
    the answer (whitespace before its marker is dropped); an echoed start marker of an answer
    that starts inside is dropped too. Text that may be the start of a marker is held until it
    is not. With `stream_reasoning` False the reasoning comes as one event when the block
    closes (SGLang's field). The markers never appear in the events.
    """

    fmt: ReasoningFormat
    starts_inside: bool = False
    stream_reasoning: bool = True
    state: str = "head"
    has_block: bool = False  # the answer had a think block (it may still be open)
    _buffer: str = ""
    _held: list[str] = field(default_factory=list)

    @property
    def is_thinking(self) -> bool:
        """Inside the block now, or about to be (an answer that starts inside)."""
        return self.state == "reasoning" or (self.state == "head" and self.starts_inside)

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning None when it had no block."""
        events = self.feed(text) + self.finish()
        reasoning = "".join(t for kind, t in events if kind == "reasoning")
        content = "".join(t for kind, t in events if kind == "content")
        return (reasoning if self.has_block else None), content

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state == "head" and not self._leave_head(final):
            return out
        if self.state == "reasoning":
            end = self._buffer.find(self.fmt.end)
            if end < 0:
                keep = 0 if final else _partial_suffix_len(self._buffer, self.fmt.end)
                cut = len(self._buffer) - keep
                self._reason(out, self._buffer[:cut], flush=final)
                self._buffer = self._buffer[cut:]
                return out
            self._reason(out, self._buffer[:end], flush=True)
            self._buffer = self._buffer[end + len(self.fmt.end):]
            self.state = "content"
        if self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return out

    def _leave_head(self, final: bool) -> bool:
        """Decide the state from the answer's start; False while it cannot be told yet."""
        body = self._buffer.lstrip()
        if body.startswith(self.fmt.start):
            self._buffer = body[len(self.fmt.start):]
            self.state = "reasoning"
        elif self.fmt.start.startswith(body) and not final:
            return False  # only whitespace so far, or the start marker being written
        else:
            self.state = "reasoning" if self.starts_inside else "content"
        self.has_block = self.state == "reasoning"
        return True

    def _reason(self, out: list[tuple[str, str]], text: str, flush: bool) -> None:
        if self.stream_reasoning:
            if text:
                out.append(("reasoning", text))
            return
        self._held.append(text)
        if flush and "".join(self._held):
            out.append(("reasoning", "".join(self._held)))
            self._held.clear()
