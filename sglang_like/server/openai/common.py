"""Helpers shared by the OpenAI-compatible routes."""

from __future__ import annotations

from typing import Any

from sglang_like.server.errors import ApiError
from sglang_like.server.openai import format as fmt
from sglang_like.server.openapi import json_content, sse_content
from sglang_like.server.state import ServerState


def ok_content(schema_name: str) -> dict[str, Any]:
    """The documented 200 of a route that answers JSON, or SSE chunks when streamed."""
    return {**json_content({"$ref": f"#/components/schemas/{schema_name}"}),
            **sse_content(schema_name.replace("Response", "Chunk"))}


def check_prompt_len(state: ServerState, prompt_len: int) -> None:
    if prompt_len >= state.context_length:
        raise ApiError(
            400,
            f"prompt is {prompt_len} tokens; the model's context length is "
            f"{state.context_length} (prompt plus completion must fit)",
        )


def logprob_kwargs(want: bool, num_top: int) -> dict[str, Any]:
    if not want:
        return {}
    return {"return_logprob": True, "top_logprobs_num": num_top, "return_text_in_logprobs": True}


def stream_usage(last_meta: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
    firsts = [m for i, m in sorted(last_meta.items()) if i % n == 0]
    return fmt.usage_dict(
        sum(int(m.get("prompt_tokens", 0)) for m in firsts),
        sum(int(m.get("completion_tokens", 0)) for m in last_meta.values()),
        sum(int(m.get("cached_tokens", 0)) for m in firsts),
    )
