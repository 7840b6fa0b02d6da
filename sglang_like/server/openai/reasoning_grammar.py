"""Structured output that reasons first: one xgrammar structural tag whose think block is free
text and whose answer after the block is held to the request's JSON schema, JSON object or tool
format.

The tag is a sequence of two parts:

    | output starts ...            | think part                             | answer part    |
    |------------------------------|----------------------------------------|----------------|
    | inside the block (R1 style)  | free text up to `</think>`             | the constraint |
    | before it (Qwen3 writes it)  | `<think>`, free text up to `</think>`  | the constraint |

The free text is xgrammar's `any_text` (it ends at the first end marker, as the reasoning reader
splits); a thinking budget is its `max_tokens`, after which only the end marker may follow. A
prompt that closed the block itself (thinking off) needs no tag: the answer is constrained from
its first token.
"""

from __future__ import annotations

import json
from typing import Any

from sglang_like.server.openai.reasoning_parser import ReasoningFormat

__all__ = ["ANSWER_KEYS", "WHOLE_OUTPUT_KEYS", "answer_format", "think_then_answer"]

# constraints that describe an answer (response_format, tools, SGLang's json_schema field): held
# after the think block; a JSON schema cannot describe a think block anyway
ANSWER_KEYS = ("json_schema", "json_object", "structural_tag")
# constraints that describe the whole output (they may spell out the think block themselves)
WHOLE_OUTPUT_KEYS = ("regex", "ebnf")
# free whitespace in JSON would let a sampled answer spin in blanks until max_tokens: at most
# one blank between tokens (xgrammar allows no 0 here; the plain JSON path has fixed separators)
_MAX_JSON_BLANKS = 1
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def answer_format(sampling: dict[str, Any]) -> dict[str, Any] | None:
    """The structural-tag format of `sampling`'s answer constraint, or None when it has none
    (ValueError for a spec that is not JSON or a structural tag with no `format`)."""
    if sampling.get("json_object"):
        return _json_format(_ANY_OBJECT)
    schema = sampling.get("json_schema")
    if schema is not None:
        return _json_format(_loaded(schema, "json_schema"))
    tag = sampling.get("structural_tag")
    if tag is None:
        return None
    tag = _loaded(tag, "structural_tag")
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise ValueError("structural_tag needs a format object to go after a think block")
    return tag["format"]


def think_then_answer(fmt: ReasoningFormat, starts_inside: bool, answer: dict[str, Any],
                      budget: int | None) -> dict[str, Any]:
    """The structural tag of a free think block, then `answer`. `starts_inside`: the prompt
    opened the block; `budget`: at most this many tokens of thinking."""
    thought: dict[str, Any] = {"type": "any_text"}
    if budget is not None:
        thought["max_tokens"] = budget
    think = {"type": "tag", "begin": "" if starts_inside else fmt.start, "content": thought,
             "end": fmt.end}
    return {"type": "structural_tag",
            "format": {"type": "sequence", "elements": [think, answer]}}


def _json_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema,
            "max_whitespace_cnt": _MAX_JSON_BLANKS}


def _loaded(spec: Any, name: str) -> Any:
    if not isinstance(spec, str):
        return spec
    try:
        return json.loads(spec)
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
