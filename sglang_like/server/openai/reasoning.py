"""A chat request's reasoning (`--reasoning-parser`): the fields it may use, how its answer is
split into `reasoning_content` and `content`, and the thinking budget.

The budget needs no engine feature: the first engine request generates at most `budget`
tokens; if the answer is still inside its think block then, a second request continues from
the prompt, those tokens and the end marker's tokens (the radix cache holds the first part, so
only the marker is prefilled anew) with what is left of max_tokens. The forced marker is part
of the answer's text, tokens and usage (its logprobs are 0: the server chose it).

An answer held to a JSON schema, a JSON object or a tool format is held after the think block
only (`ReasoningPlan.constrain`, reasoning_grammar): one grammar, the block free text; under it
the budget is the grammar's too, so no second request is needed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import jinja2.meta

from sglang_like.server.errors import ApiError
from sglang_like.server.native_api import choice_params
from sglang_like.server.openai.reasoning_grammar import (
    ANSWER_KEYS,
    WHOLE_OUTPUT_KEYS,
    answer_format,
    think_then_answer,
)
from sglang_like.server.openai.reasoning_parser import (
    ReasoningFormat,
    ReasoningReader,
    closes_in_prompt,
    get_reasoning_format,
    opens_in_prompt,
)
from sglang_like.server.runner import EngineRunner, EngineStream
from sglang_like.tokenizer import compile_chat_template

__all__ = ["BudgetStream", "ReasoningPlan", "check_template_kwargs", "generate_with_budget"]

_CONSTRAINT_KEYS = WHOLE_OUTPUT_KEYS + ANSWER_KEYS
# what the chat route passes to the template itself; a kwarg may not replace them
_TEMPLATE_ARGS = ("messages", "tools", "documents", "add_generation_prompt")


def check_template_kwargs(kwargs: dict[str, Any] | None,
                          chat_template: str | None) -> dict[str, Any]:
    """The request's chat_template_kwargs, checked: none may replace what the route passes, and
    each must be a variable the template reads (else it would be silently ignored: 400)."""
    kwargs = kwargs or {}
    names = _template_variables(chat_template) if kwargs and chat_template else frozenset()
    for key in kwargs:
        if key in _TEMPLATE_ARGS:
            raise ApiError(400, f"chat_template_kwargs may not set {key!r}",
                           "chat_template_kwargs")
        if key not in names:
            raise ApiError(400, f"chat_template_kwargs: this model's chat template does not "
                                f"read {key!r}", "chat_template_kwargs")
    return kwargs


@functools.lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its context."""
    env = compile_chat_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


@dataclass(frozen=True)
class ReasoningPlan:
    """What one chat request does with reasoning. `starts_inside`: the answer begins inside the
    think block (the format says so, or the rendered prompt left it open)."""

    fmt: ReasoningFormat
    starts_inside: bool
    separate: bool  # split the answer (SGLang's separate_reasoning); else raw text
    stream_reasoning: bool  # stream reasoning as it comes; else in one piece at the block's end
    budget: int | None  # at most this many answer tokens before the block is closed
    thinks: bool = True  # False: the prompt closed the block (thinking off), the answer follows

    @classmethod
    def build(cls, parser: str | None, default_budget: int | None, req: Any,
              prompt: str) -> ReasoningPlan | None:
        """The plan of `req` (a ChatCompletionRequest), None on a server without a parser.
        Without one, a field asking for reasoning behaviour is a 400 naming it."""
        budget = req.thinking_budget if req.thinking_budget is not None else default_budget
        if parser is None:
            if req.thinking_budget is not None:
                raise ApiError(400, "thinking_budget needs a server started with "
                                    "--reasoning-parser", "thinking_budget")
            if not req.stream_reasoning:
                raise ApiError(400, "stream_reasoning needs a server started with "
                                    "--reasoning-parser", "stream_reasoning")
            return None
        fmt = get_reasoning_format(parser)
        # a prompt that closed the block turned thinking off, whatever the format's habit
        thinks = not closes_in_prompt(fmt, prompt)
        return cls(fmt, thinks and opens_in_prompt(fmt, prompt), req.separate_reasoning,
                   req.stream_reasoning, budget, thinks=thinks)

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.fmt, self.starts_inside, self.stream_reasoning)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content) of a whole answer."""
        return self.reader().split(text)

    def sampling_params(self, sampling: dict[str, Any],
                        grammar_backend: str = "xgrammar") -> dict[str, Any]:
        """`sampling` as this plan needs it, for a caller that runs the budget as a second
        request: ApiError(400) for a budget under a constraint (the second request would start
        the grammar over; `constrain` holds the budget in the grammar instead)."""
        own = [k for k in _CONSTRAINT_KEYS if sampling.get(k) not in (None, False)]
        if self.budget is not None and own:
            raise ApiError(400, f"thinking_budget cannot be combined with {own[0]} "
                                "(response_format, tools or a constraint field)",
                           "thinking_budget")
        return self.constrain(sampling, grammar_backend)[1]

    def constrain(self, sampling: dict[str, Any], grammar_backend: str
                  ) -> tuple[ReasoningPlan, dict[str, Any]]:
        """(plan, sampling) of a request: a JSON schema, JSON object or tool format in
        `sampling` is moved after a free think block (one structural tag, which also closes the
        block at the budget: the plan returned then has no budget of its own to run). A regex
        or EBNF holds the whole output, as without a parser (no budget with them: 400)."""
        out = dict(sampling)
        if self.fmt.needs_special_tokens:
            out["skip_special_tokens"] = False
        whole = [k for k in WHOLE_OUTPUT_KEYS if out.get(k) is not None]
        if whole and self.budget is not None:
            raise ApiError(400, f"thinking_budget cannot be combined with {whole[0]} (it holds "
                                "the whole output, think block included)", "thinking_budget")
        try:
            answer = answer_format(out)
        except ValueError as e:
            raise ApiError(400, str(e), "response_format") from None
        if answer is None:
            return self, out
        if not self.thinks:  # the prompt closed the block: the answer is held from the start
            return replace(self, budget=None), out
        self._check_grammar(grammar_backend)
        for key in ANSWER_KEYS:
            out.pop(key, None)
        out["structural_tag"] = think_then_answer(self.fmt, self.starts_inside, answer,
                                                  self.budget)
        return replace(self, budget=None), out

    def _check_grammar(self, grammar_backend: str) -> None:
        """400s for what one grammar cannot hold here (rather than a constraint that would
        forbid thinking, or none)."""
        if grammar_backend != "xgrammar":
            raise ApiError(400, "response_format or tools with --reasoning-parser need "
                                "--grammar-backend xgrammar (the think block and the answer "
                                f"are one structural tag; {grammar_backend} has none)",
                           "response_format")
        if self.fmt.needs_special_tokens:
            raise ApiError(400, f"response_format or tools with the {self.fmt.name} reasoning "
                                f"format: its {self.fmt.start} markers are special tokens, "
                                "which no grammar here may write", "response_format")

    @property
    def has_budget(self) -> bool:
        return self.budget is not None

    def first_max_tokens(self, max_tokens: int) -> int:
        assert self.budget is not None
        return min(self.budget, max_tokens)

    def forced_text(self, text: str) -> str:
        """What the server writes after a first request's `text` that used up the budget:
        the end marker inside the block, an empty block before the answer began, else ""."""
        reader = self.reader()
        reader.feed(text)
        if reader.is_thinking:
            return self.fmt.end
        if reader.state == "head" and not text.strip():
            return self.fmt.start + self.fmt.end
        return ""


@dataclass(frozen=True)
class _Continuation:
    input_ids: list[int]
    max_new_tokens: int
    forced_ids: list[int]
    forced_text: str


def _continuation(plan: ReasoningPlan, tokenizer: Any, prompt_ids: list[int], text: str,
                  output_ids: list[int], meta: dict[str, Any], first_max: int,
                  max_tokens: int) -> _Continuation | None:
    """The second request after a finished first one, or None when the answer is complete:
    it stopped by itself, or max_tokens (not the budget) ended it."""
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "length" or first_max >= max_tokens:
        return None
    forced_text = plan.forced_text(text)
    forced_ids = list(tokenizer.encode(forced_text)) if forced_text else []
    left = max_tokens - len(output_ids) - len(forced_ids)
    if left < 1:
        return None
    return _Continuation(prompt_ids + output_ids + forced_ids, left, forced_ids, forced_text)


def _forced_logprobs(meta: dict[str, Any], ids: list[int], tokenizer: Any) -> dict[str, Any]:
    """The forced tokens' logprob entries (0: chosen with certainty) after `meta`'s."""
    if "output_token_logprobs" not in meta:
        return {}
    entries = [[0.0, t, tokenizer.decode([t])] for t in ids]
    return {"output_token_logprobs": list(meta["output_token_logprobs"] or []) + entries,
            "output_top_logprobs": list(meta.get("output_top_logprobs") or []) + [[]] * len(ids)}


def _joined(first: dict[str, Any], cont: _Continuation, second: dict[str, Any],
            tokenizer: Any) -> dict[str, Any]:
    """One result out of the two requests' results and the forced tokens between them."""
    m1, m2 = first.get("meta_info") or {}, second.get("meta_info") or {}
    meta = {**m2, "prompt_tokens": m1.get("prompt_tokens", 0),
            "cached_tokens": m1.get("cached_tokens", 0),
            "completion_tokens": int(m1.get("completion_tokens", 0)) + len(cont.forced_ids)
            + int(m2.get("completion_tokens", 0))}
    lps = _forced_logprobs(m1, cont.forced_ids, tokenizer)
    if lps:
        meta["output_token_logprobs"] = lps["output_token_logprobs"] + list(
            m2.get("output_token_logprobs") or [])
        meta["output_top_logprobs"] = lps["output_top_logprobs"] + list(
            m2.get("output_top_logprobs") or [])
    return {"text": first.get("text", "") + cont.forced_text + second.get("text", ""),
            "output_ids": list(first.get("output_ids") or []) + cont.forced_ids
            + list(second.get("output_ids") or []),
            "meta_info": meta}


async def generate_with_budget(
    runner: EngineRunner, request: Any, base: dict[str, Any], sampling: dict[str, Any], n: int,
    plan: ReasoningPlan, tokenizer: Any,
) -> list[dict[str, Any]]:
    """The n choices of a non-streamed request under the plan's budget (one engine request per
    choice, and a second one for each choice whose block the budget closed)."""
    max_tokens = sampling["max_new_tokens"]
    first_max = plan.first_max_tokens(max_tokens)
    params = [choice_params({**sampling, "max_new_tokens": first_max}, j) for j in range(n)]
    firsts = await runner.generate(request, [{**base, "sampling_params": p} for p in params])
    conts = [_continuation(plan, tokenizer, base["input_ids"], r.get("text", ""),
                           list(r.get("output_ids") or []), r.get("meta_info") or {},
                           first_max, max_tokens) for r in firsts]
    todo = [j for j, c in enumerate(conts) if c is not None]
    seconds = await runner.generate(request, [
        {**base, "input_ids": conts[j].input_ids,
         "sampling_params": {**params[j], "max_new_tokens": conts[j].max_new_tokens}}
        for j in todo]) if todo else []
    out = list(firsts)
    for j, second in zip(todo, seconds, strict=True):
        out[j] = _joined(firsts[j], conts[j], second, tokenizer)
    return out


class BudgetStream:
    """A streamed choice under the budget, iterated like an EngineStream: the first request's
    chunks, then (where the budget closed the block) one chunk carrying the forced marker and
    the second request's chunks, with counts continued from the first."""

    def __init__(self, runner: EngineRunner, first: EngineStream, call: dict[str, Any],
                 owner: str | None, plan: ReasoningPlan, tokenizer: Any, max_tokens: int) -> None:
        self._runner, self._owner, self._plan, self._tokenizer = runner, owner, plan, tokenizer
        self._current = first
        self._call = call
        self._max_tokens = max_tokens
        self._text = ""
        self._ids: list[int] = []
        self._first_meta: dict[str, Any] | None = None  # set once the second request runs
        self._offset = 0  # completion tokens before the second request's

    def __aiter__(self) -> BudgetStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        chunk = await self._current.__anext__()
        if self._first_meta is not None:
            return self._shifted(chunk)
        self._text += chunk.get("text", "")
        self._ids += list(chunk.get("output_ids") or [])
        meta = chunk.get("meta_info") or {}
        if meta.get("finish_reason") is None:
            return chunk
        first_max = self._call["sampling_params"]["max_new_tokens"]
        cont = _continuation(self._plan, self._tokenizer, self._call["input_ids"], self._text,
                             self._ids, meta, first_max, self._max_tokens)
        if cont is None:
            return chunk
        await self._current.aclose()
        second = {**self._call, "input_ids": cont.input_ids, "sampling_params": {
            **self._call["sampling_params"], "max_new_tokens": cont.max_new_tokens}}
        self._current = await self._runner.open_stream(self._owner, **second)
        self._first_meta = meta
        self._offset = int(meta.get("completion_tokens", 0)) + len(cont.forced_ids)
        joined = {**meta, "finish_reason": None, "completion_tokens": self._offset,
                  **_forced_logprobs(meta, cont.forced_ids, self._tokenizer)}
        return {"text": chunk.get("text", "") + cont.forced_text,
                "output_ids": list(chunk.get("output_ids") or []) + cont.forced_ids,
                "meta_info": joined}

    def _shifted(self, chunk: dict[str, Any]) -> dict[str, Any]:
        first = self._first_meta or {}
        meta = dict(chunk.get("meta_info") or {})
        meta["completion_tokens"] = self._offset + int(meta.get("completion_tokens", 0))
        meta["prompt_tokens"] = first.get("prompt_tokens", 0)
        meta["cached_tokens"] = first.get("cached_tokens", 0)
        return {**chunk, "meta_info": meta}

    async def aclose(self) -> None:
        await self._current.aclose()
