"""Pure functions turning engine results into OpenAI response objects (completion and chat)."""

from __future__ import annotations

import time
import uuid
from typing import Any

Entry = list[Any]  # [logprob | None, token_id, text | None]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(meta_info: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason for the engine's {"type": ...}: stop, length, or abort."""
    reason = meta_info.get("finish_reason")
    if not isinstance(reason, dict):
        return None
    kind = reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def internal_error(results: list[Any]) -> str | None:
    """The message of the first result that ended with an internal error (a fault in the
    runtime, not the request), else None. OpenAI's finish reasons cannot say why: such an
    answer is a 500 with the message, which the official client raises (and retries)."""
    for result in results:
        for item in result if isinstance(result, list) else [result]:
            reason = (item.get("meta_info") or {}).get("finish_reason") or {}
            message = reason.get("message") or ""
            if reason.get("type") == "abort" and message.startswith("internal error"):
                return message
    return None


def matched_stop(meta_info: dict[str, Any]) -> str | int | None:
    reason = meta_info.get("finish_reason")
    return reason.get("matched") if isinstance(reason, dict) else None


def usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of one request's choices: the prompt counted once, completions summed."""
    metas = [r.get("meta_info") or {} for r in results]
    prompt_tokens = int(metas[0].get("prompt_tokens", 0)) if metas else 0
    completion_tokens = sum(int(m.get("completion_tokens", 0)) for m in metas)
    cached_tokens = int(metas[0].get("cached_tokens", 0)) if metas else 0
    return usage_dict(prompt_tokens, completion_tokens, cached_tokens)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def merge_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage over several prompts of one /v1/completions request."""
    return usage_dict(
        sum(u["prompt_tokens"] for u in parts),
        sum(u["completion_tokens"] for u in parts),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in parts),
    )


def _token_text(entry: Entry) -> str:
    return entry[2] if len(entry) > 2 and entry[2] is not None else ""


def _tops(top_list: list[Any] | None, i: int) -> list[Entry]:
    if not top_list or i >= len(top_list) or top_list[i] is None:
        return []
    return list(top_list[i])


def completion_logprobs(
    entries: list[Entry], tops: list[Any] | None, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, offsets.

    As OpenAI and vLLM do, each top_logprobs dict holds the k most likely tokens and the chosen
    one (so `logprobs=0` still names it); an entry with no logprob (the first prompt token,
    which nothing predicts) has None there."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for i, entry in enumerate(entries):
        text = _token_text(entry)
        tokens.append(text)
        token_logprobs.append(entry[0])
        top: dict[str, float] | None = None
        if entry[0] is not None:
            top = {_token_text(t): t[0] for t in _tops(tops, i)}
            top.setdefault(text, entry[0])
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs(meta_info: dict[str, Any]) -> dict[str, Any]:
    """The echoed prompt's part of a completion `logprobs` object (offsets from 0)."""
    return completion_logprobs(
        meta_info.get("input_token_logprobs") or [], meta_info.get("input_top_logprobs")
    )


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completion `logprobs` objects one after the other (the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: list[Entry], tops: list[Any] | None) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    content = []
    for i, entry in enumerate(entries):
        text = _token_text(entry)
        content.append(
            {
                "token": text,
                "logprob": entry[0],
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _token_text(t),
                        "logprob": t[0],
                        "bytes": list(_token_text(t).encode("utf-8")),
                    }
                    for t in _tops(tops, i)
                ],
            }
        )
    return {"content": content}


def completion_choice(
    index: int, result: dict[str, Any], want_logprobs: bool, echo_text: str = ""
) -> dict[str, Any]:
    """One /v1/completions choice; with `echo_text` (echo=true) its logprobs cover the prompt
    tokens first (the engine was asked for them from position 0), then the generated ones."""
    meta = result.get("meta_info") or {}
    logprobs = None
    if want_logprobs:
        logprobs = completion_logprobs(
            meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
            len(echo_text),
        )
        if echo_text:
            logprobs = join_logprobs(prompt_logprobs(meta), logprobs)
    return {
        "index": index,
        "text": echo_text + result.get("text", ""),
        "logprobs": logprobs,
        "finish_reason": finish_reason(meta),
        "matched_stop": matched_stop(meta),
    }


def chat_choice(index: int, result: dict[str, Any], want_logprobs: bool) -> dict[str, Any]:
    meta = result.get("meta_info") or {}
    logprobs = None
    if want_logprobs:
        logprobs = chat_logprobs(
            meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs")
        )
    return {
        "index": index,
        "message": {"role": "assistant", "content": result.get("text", ""), "tool_calls": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason(meta),
        "matched_stop": matched_stop(meta),
    }


__all__ = [
    "chat_choice",
    "chat_logprobs",
    "completion_choice",
    "completion_logprobs",
    "finish_reason",
    "join_logprobs",
    "merge_usage",
    "new_id",
    "now",
    "prompt_logprobs",
    "usage",
]
