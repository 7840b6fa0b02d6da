"""SGLang-native routes: /generate, model and server info, health, cache flush, abort.

A route that asks the engine something (`get_server_info`, `get_load`, `flush_cache`) waits for
it on a worker thread: the engine answers between scheduler steps, and the event loop must keep
streaming other requests' tokens meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.config import SECRET_SERVER_ARGS
from sglang_like.server import lora_api
from sglang_like.server.auth import principal_of
from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.openapi import TEXT_CONTENT, json_content, operation, sse_content
from sglang_like.server.protocol import AbortRequest, GenerateRequest, parse_model
from sglang_like.server.runner import ClientGone, EngineStream, check_rid, merge_streams
from sglang_like.server.sse import DONE, open_streams, sse, sse_response
from sglang_like.server.state import get_state

router = APIRouter()
_HEALTH_TIMEOUT_S = 30.0


@router.post("/generate", openapi_extra=operation(
    body=GenerateRequest,
    ok={**json_content({"$ref": "#/components/schemas/GenerateResponse"}),
        **sse_content("GenerateResult")},
    errors=(400, 401, 429),
))
async def generate(request: Request) -> Response:
    state = get_state(request)
    body = parse_model(GenerateRequest, await read_json_body(request))
    if body.text is not None:
        state.check_text_length(body.text, "text")
    kwargs = body.engine_kwargs()
    if "lora_path" in kwargs:
        lora_api.require_lora(state)
    if body.stream:
        streams = await open_streams(
            state.runner, _split_for_streaming(kwargs, body.is_batch), request
        )
        return sse_response(_native_events(streams), streams)
    try:
        (result,) = await state.runner.generate(request, [kwargs])
    except ClientGone:
        return Response(status_code=499)
    return json_response(result)


async def _native_events(streams: list[EngineStream]) -> AsyncIterator[str]:
    """SGLang's stream shape: cumulative text and ids; logprobs of the new tokens only."""
    texts = [""] * len(streams)
    ids: list[list[int]] = [[] for _ in streams]
    num_logprobs = [0] * len(streams)
    async for index, chunk in merge_streams(streams):
        meta = dict(chunk.get("meta_info") or {})
        texts[index] += chunk.get("text", "")
        ids[index].extend(chunk.get("output_ids") or [])
        if "output_token_logprobs" in meta:
            num_logprobs[index] += len(meta["output_token_logprobs"] or [])
            meta["output_token_logprobs_length"] = num_logprobs[index]
        out: dict[str, Any] = {
            "text": texts[index], "output_ids": list(ids[index]), "meta_info": meta
        }
        if len(streams) > 1:
            out["index"] = index
        yield sse(out)
    yield DONE


def _split_for_streaming(kwargs: dict[str, Any], is_batch: bool) -> list[dict[str, Any]]:
    """One single-prompt, n=1 engine call per streamed output (index = prompt * n + choice)."""
    key = "prompt" if kwargs["prompt"] is not None else "input_ids"
    prompts = kwargs[key] if is_batch else [kwargs[key]]
    sampling = kwargs["sampling_params"]
    rids = kwargs["rid"]
    calls = []
    for i, prompt in enumerate(prompts):
        params = dict((sampling[i] if isinstance(sampling, list) else sampling) or {})
        rid = rids[i] if isinstance(rids, list) else rids
        n = int(params.get("n", 1) or 1)
        for choice in range(n):
            call = {k: v for k, v in kwargs.items() if k not in ("prompt", "input_ids")}
            call[key] = prompt
            for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "lora_path"):
                if isinstance(call.get(name), list):  # a batch's: this prompt's entry
                    call[name] = call[name][i]
            if is_batch and call.get("image_data") is not None:  # this prompt's image(s)
                call["image_data"] = call["image_data"][i]
            call["sampling_params"] = choice_params(params, choice)
            call["rid"] = None if rid is None else (rid if n == 1 else f"{rid}-{choice}")
            calls.append(call)
    return calls


def choice_params(params: dict[str, Any], choice: int) -> dict[str, Any]:
    """Sampling params of the `choice`-th of n separately run samples: n=1, seed offset."""
    out = {**params, "n": 1}
    if out.get("seed") is not None:
        out["seed"] = out["seed"] + choice
    return out


_MODEL_INFO = operation(ok=json_content({"type": "object"}))


# sglang-router asks /model_info first and falls back to SGLang's older /get_model_info
@router.get("/get_model_info", openapi_extra=_MODEL_INFO)
@router.get("/model_info", openapi_extra=_MODEL_INFO)
async def get_model_info(request: Request) -> Response:
    state = get_state(request)
    return json_response(
        {
            "model_path": state.model_path,
            "tokenizer_path": state.server_args.tokenizer_path or state.model_path,
            "served_model_name": state.served_model_name,
            "is_generation": not state.server_args.is_embedding,
            "chat_template": getattr(state.tokenizer, "chat_template", None),
            "context_length": state.context_length,
        }
    )


_SERVER_INFO = operation(ok=json_content({"$ref": "#/components/schemas/ServerInfo"}))


@router.get("/get_server_info", openapi_extra=_SERVER_INFO)
@router.get("/server_info", openapi_extra=_SERVER_INFO)
async def get_server_info(request: Request) -> Response:
    state = get_state(request)
    info: dict[str, Any] = dataclasses.asdict(state.server_args)
    info["served_model_name"] = state.served_model_name
    info.update(await run_in_threadpool(state.engine.get_server_info))
    for name in SECRET_SERVER_ARGS:
        info.pop(name, None)
    return json_response(info)


@router.get("/get_load", openapi_extra=operation(
    ok=json_content({"type": "array", "items": {"$ref": "#/components/schemas/Load"}})
))
async def get_load(request: Request) -> Response:
    """SGLang's shape: one entry per data-parallel rank (this server has one); sglang-router's
    power_of_two policy and its own /get_loads read it."""
    return json_response([await run_in_threadpool(get_state(request).engine.get_load)])


@router.get("/health", openapi_extra=operation(ok_description="Healthy", errors=(503,)))
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 with the engine's reason (dead loop, stuck step)."""
    reason = _unhealthy_reason(get_state(request).engine)
    if reason is not None:
        raise ApiError(503, reason)
    return Response(status_code=200)


def _unhealthy_reason(engine: Any) -> str | None:
    check = getattr(engine, "check_health", None)
    if check is None:
        return None
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - a check that cannot run is not a healthy answer
        return f"the engine's health check failed: {type(e).__name__}: {e}"


@router.get("/health_generate", openapi_extra=operation(
    ok_description="One token was generated", errors=(401, 503)
))
async def health_generate(request: Request) -> Response:
    """Healthy when one token can be generated within the timeout."""
    state = get_state(request)
    call = {"prompt": "Hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    try:
        await asyncio.wait_for(state.runner.generate(request, [call]), _HEALTH_TIMEOUT_S)
    except ClientGone:
        return Response(status_code=499)
    except (asyncio.TimeoutError, ApiError) as e:
        raise ApiError(503, f"generation is not healthy: {e or 'timed out'}") from None
    return Response(status_code=200)


_FLUSH_CACHE = operation(ok=TEXT_CONTENT, errors=(400, 401))


# POST only: a state change behind a GET is one a link or an <img> on any page can trigger
@router.post("/flush_cache", openapi_extra=_FLUSH_CACHE)
async def flush_cache(request: Request) -> Response:
    state = get_state(request)
    if not await run_in_threadpool(state.engine.flush_cache):
        raise ApiError(400, "cache not flushed: requests are still running; retry when idle")
    return Response("Cache flushed.\n", status_code=200, media_type="text/plain")


@router.post("/abort_request", openapi_extra=operation(
    body=AbortRequest, ok_description="Aborted (or already finished)",
    errors=(400, 401, 403, 404)
))
async def abort_request(request: Request) -> Response:
    """SGLang's body: {"rid": "<id>"} ends that request (and its n > 1 samples / batch items);
    {"abort_all": true} ends every queued and running request. A tenant's key ends only the
    requests it sent (404 for any other rid, so it learns nothing of others'); ending another's
    request, or all, takes the admin key."""
    state = get_state(request)
    body = parse_model(AbortRequest, await read_json_body(request))
    principal = principal_of(request.scope)
    if body.abort_all:
        if not principal.is_admin:
            raise ApiError(403, "abort_all needs the admin API key", "abort_all")
        abort_all = getattr(state.engine, "abort_all", None)
        if abort_all is None:
            raise ApiError(400, "this engine cannot abort all requests; give a rid")
        abort_all()
    elif body.rid:
        check_rid(body.rid)
        if not state.runner.abort_for(body.rid, principal):
            raise ApiError(404, "no running request of yours has this rid", "rid")
    else:
        raise ApiError(
            400, 'abort_request needs {"rid": "<request id>"} or {"abort_all": true}', "rid"
        )
    return Response(status_code=200)
