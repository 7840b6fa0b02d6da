"""POST /v1/chat/completions: OpenAI's chat completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.native_api import choice_params
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.common import (
    check_prompt_len,
    logprob_kwargs,
    ok_content,
    stream_usage,
)
from sglang_like.server.openapi import operation
from sglang_like.server.protocol import ChatCompletionRequest, parse_model
from sglang_like.server.runner import ClientGone, EngineStream, merge_streams
from sglang_like.server.sse import DONE, open_streams, sse, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")


@router.post("/chat/completions", openapi_extra=operation(
    body=ChatCompletionRequest, ok=ok_content("ChatCompletionResponse"), errors=(400, 401, 429, 500)
))
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(ChatCompletionRequest, await read_json_body(request))
    req.check(state.context_length)
    input_ids = _chat_input_ids(state, req)
    check_prompt_len(state, len(input_ids))
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = max(1, state.context_length - len(input_ids))
    sampling = req.sampling_dict(max_tokens)
    base = {"input_ids": input_ids, **logprob_kwargs(req.logprobs, req.top_logprobs or 0)}
    if req.stream:
        calls = [
            {**base, "sampling_params": choice_params(sampling, j)} for j in range(req.n)
        ]
        streams = await open_streams(state.runner, calls, request)
        return sse_response(_chat_events(state, req, streams), streams)
    try:
        (result,) = await state.runner.generate(
            request, [{**base, "sampling_params": {**sampling, "n": req.n}}]
        )
    except ClientGone:
        return Response(status_code=499)
    if (message := fmt.internal_error([result])) is not None:
        raise ApiError(500, message)
    items = result if isinstance(result, list) else [result]
    return json_response(
        {
            "id": fmt.new_id("chatcmpl"),
            "object": "chat.completion",
            "created": fmt.now(),
            "model": state.served_model_name,
            "choices": [fmt.chat_choice(j, item, req.logprobs) for j, item in enumerate(items)],
            "usage": fmt.usage(items),
        }
    )


async def _chat_events(
    state: ServerState, req: ChatCompletionRequest, streams: list[EngineStream]
) -> AsyncIterator[str]:
    head = {"id": fmt.new_id("chatcmpl"), "object": "chat.completion.chunk",
            "created": fmt.now(), "model": state.served_model_name}
    for index in range(len(streams)):
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        yield sse({**head, "choices": [choice]})
    last_meta: dict[int, dict[str, Any]] = {}
    async for index, chunk in merge_streams(streams):
        meta = chunk.get("meta_info") or {}
        last_meta[index] = meta
        text = chunk.get("text", "")
        reason = fmt.finish_reason(meta)
        if not text and reason is None:
            continue
        logprobs = None
        if req.logprobs:
            logprobs = fmt.chat_logprobs(
                meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs")
            )
        delta = {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = fmt.matched_stop(meta)
        yield sse({**head, "choices": [choice]})
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": stream_usage(last_meta, req.n)})
    yield DONE



def _chat_input_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    messages = [m.template_dict() for m in req.messages]
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=not req.continue_final_message, tools=req.tools
        )
    except Exception as e:  # noqa: BLE001 - a template's own error is about this request
        raise ApiError(400, f"chat template failed on these messages: {e}") from None
    if req.continue_final_message:
        prompt = _strip_end_of_turn(prompt, messages[-1]["content"])
    return list(tokenizer.encode(prompt))



def _strip_end_of_turn(prompt: str, last_content: str) -> str:
    """Cut the template's end-of-turn text after the final message, so the model continues it."""
    cut = prompt.rfind(last_content)
    return prompt[: cut + len(last_content)] if cut >= 0 and last_content else prompt


