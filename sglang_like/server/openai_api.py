"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server import openai_format as fmt
from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.native_api import choice_params
from sglang_like.server.openapi import json_content, operation, sse_content
from sglang_like.server.protocol import ChatCompletionRequest, CompletionRequest, parse_model
from sglang_like.server.runner import ClientGone, EngineStream, merge_streams
from sglang_like.server.sse import DONE, open_streams, sse, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")


def _ok(schema_name: str) -> dict[str, Any]:
    return {**json_content({"$ref": f"#/components/schemas/{schema_name}"}),
            **sse_content(schema_name.replace("Response", "Chunk"))}


@router.get("/models", openapi_extra=operation(
    ok=json_content({"$ref": "#/components/schemas/ModelList"})
))
async def list_models(request: Request) -> Response:
    state = get_state(request)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": fmt.now(),
        "owned_by": "sglang_like",
        "root": state.model_path,
        "max_model_len": state.context_length,
    }
    return json_response({"object": "list", "data": [card]})


# ---- /v1/completions ----------------------------------------------------------------------
@router.post("/completions", openapi_extra=operation(
    body=CompletionRequest, ok=_ok("CompletionResponse"), errors=(400, 401, 429, 500)
))
async def completions(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(CompletionRequest, await read_json_body(request))
    req.check(state.context_length)
    prompts = req.prompts()
    for prompt in prompts:
        if isinstance(prompt, list):
            _check_prompt_len(state, len(prompt))
    sampling = req.sampling_dict(req.max_tokens or 16)
    want_logprobs = req.logprobs is not None
    base = _logprob_kwargs(want_logprobs, req.logprobs or 0)
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
        events = _completion_events(state, req, streams, echoes, want_logprobs)
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
            "model": state.served_model_name,
            "choices": choices,
            "usage": fmt.merge_usage(usages),
        }
    )


async def _completion_events(
    state: ServerState, req: CompletionRequest, streams: list[EngineStream],
    echoes: list[str], want_logprobs: bool,
) -> AsyncIterator[str]:
    head = {"id": fmt.new_id("cmpl"), "object": "text_completion", "created": fmt.now(),
            "model": state.served_model_name}
    last_meta: dict[int, dict[str, Any]] = {}
    offsets = [0] * len(streams)
    for index in range(len(streams)):
        echo = echoes[index // req.n]
        if echo:
            offsets[index] = len(echo)
            choice = {"index": index, "text": echo, "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [choice]})
    async for index, chunk in merge_streams(streams):
        meta = chunk.get("meta_info") or {}
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
        yield sse({**head, "choices": [], "usage": _stream_usage(last_meta, req.n)})
    yield DONE


# ---- /v1/chat/completions -----------------------------------------------------------------
@router.post("/chat/completions", openapi_extra=operation(
    body=ChatCompletionRequest, ok=_ok("ChatCompletionResponse"), errors=(400, 401, 429, 500)
))
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(ChatCompletionRequest, await read_json_body(request))
    req.check(state.context_length)
    input_ids = _chat_input_ids(state, req)
    _check_prompt_len(state, len(input_ids))
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = max(1, state.context_length - len(input_ids))
    sampling = req.sampling_dict(max_tokens)
    base = {"input_ids": input_ids, **_logprob_kwargs(req.logprobs, req.top_logprobs or 0)}
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
        yield sse({**head, "choices": [], "usage": _stream_usage(last_meta, req.n)})
    yield DONE


# ---- helpers ------------------------------------------------------------------------------
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


def _check_prompt_len(state: ServerState, prompt_len: int) -> None:
    if prompt_len >= state.context_length:
        raise ApiError(
            400,
            f"prompt is {prompt_len} tokens; the model's context length is "
            f"{state.context_length} (prompt plus completion must fit)",
        )


def _prompt_kwargs(prompt: str | list[int]) -> dict[str, Any]:
    return {"input_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


def _logprob_kwargs(want: bool, num_top: int) -> dict[str, Any]:
    if not want:
        return {}
    return {"return_logprob": True, "top_logprobs_num": num_top, "return_text_in_logprobs": True}


def _stream_usage(last_meta: dict[int, dict[str, Any]], n: int) -> dict[str, Any]:
    firsts = [m for i, m in sorted(last_meta.items()) if i % n == 0]
    return fmt.usage_dict(
        sum(int(m.get("prompt_tokens", 0)) for m in firsts),
        sum(int(m.get("completion_tokens", 0)) for m in last_meta.values()),
        sum(int(m.get("cached_tokens", 0)) for m in firsts),
    )
