"""POST /v1/completions: OpenAI's legacy text completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.native_api import choice_params
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.common import (
    check_prompt_len,
    logprob_kwargs,
    ok_content,
    stream_usage,
)
from sglang_like.server.openapi import operation
from sglang_like.server.protocol import CompletionRequest, bootstrap_kwargs, parse_model
from sglang_like.server.runner import ClientGone, EngineStream, merge_streams
from sglang_like.server.sse import DONE, open_streams, sse, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")


@router.post("/completions", openapi_extra=operation(
    body=CompletionRequest, ok=ok_content("CompletionResponse"), errors=(400, 401, 404, 429, 500)
))
async def completions(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(CompletionRequest, await read_json_body(request))
    req.check(state.context_length)
    lora, model = resolve_model(state, req.model, req.lora_path)
    prompts = req.prompts()
    state.check_text_length([p for p in prompts if isinstance(p, str)])
    for prompt in prompts:
        if isinstance(prompt, list):
            check_prompt_len(state, len(prompt))
    sampling = req.sampling_dict(req.max_new_tokens)
    want_logprobs = req.logprobs is not None
    base = {**logprob_kwargs(want_logprobs, req.logprobs or 0), **bootstrap_kwargs(req),
            **lora}
    if want_logprobs and req.echo:
        base["logprob_start_len"] = 0  # the echoed prompt's tokens get logprobs too
    calls = [
        {**_prompt_kwargs(p), **base, "sampling_params": {**sampling, "n": req.n}}
        for p in prompts
    ]
    echoes = [_echo_text(state, p) if req.echo else "" for p in prompts]
    if req.stream:
        stream_calls = [
            {**call, "sampling_params": choice_params(call["sampling_params"], j)}
            for call in calls
            for j in range(req.n)
        ]
        streams = await open_streams(state.runner, stream_calls, request)
        events = _completion_events(model, req, streams, echoes, want_logprobs)
        return sse_response(events, streams)
    try:
        results = await state.runner.generate(request, calls)
    except ClientGone:
        return Response(status_code=499)
    if (message := fmt.internal_error(results)) is not None:
        raise ApiError(500, message)
    choices, usages = [], []
    for i, result in enumerate(results):
        items = result if isinstance(result, list) else [result]
        usages.append(fmt.usage(items))
        for j, item in enumerate(items):
            choices.append(fmt.completion_choice(i * req.n + j, item, want_logprobs, echoes[i]))
    return json_response(
        {
            "id": fmt.new_id("cmpl"),
            "object": "text_completion",
            "created": fmt.now(),
            "model": model,
            "choices": choices,
            "usage": fmt.merge_usage(usages),
        }
    )


async def _completion_events(
    model: str, req: CompletionRequest, streams: list[EngineStream],
    echoes: list[str], want_logprobs: bool,
) -> AsyncIterator[str]:
    head = {"id": fmt.new_id("cmpl"), "object": "text_completion", "created": fmt.now(),
            "model": model}
    last_meta: dict[int, dict[str, Any]] = {}
    offsets = [0] * len(streams)
    async for index, chunk in merge_streams(streams):
        meta = chunk.get("meta_info") or {}
        echo = echoes[index // req.n]
        if echo and index not in last_meta:
            # the prompt goes out first, with its logprobs (they come with the first chunk)
            offsets[index] = len(echo)
            logprobs = fmt.prompt_logprobs(meta) if want_logprobs else None
            choice = {"index": index, "text": echo, "logprobs": logprobs, "finish_reason": None}
            yield sse({**head, "choices": [choice]})
        last_meta[index] = meta
        text = chunk.get("text", "")
        reason = fmt.finish_reason(meta)
        if not text and reason is None:
            continue
        logprobs = None
        if want_logprobs:
            logprobs = fmt.completion_logprobs(
                meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
                offsets[index],
            )
        offsets[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = fmt.matched_stop(meta)
        yield sse({**head, "choices": [choice]})
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": stream_usage(last_meta, req.n)})
    yield DONE


def _prompt_kwargs(prompt: str | list[int]) -> dict[str, Any]:
    return {"input_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


