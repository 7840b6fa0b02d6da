"""LoRA adapters over HTTP (issue #50): SGLang's admin routes /load_lora_adapter and
/unload_lora_adapter, the adapters /v1/models lists, and the adapter an OpenAI request's
`model` names.

The answers keep SGLang's shape (`success`, `error_message`, `loaded_adapters`: name -> path)
and add this server's facts about the adapter (rank, targets, bytes; the names a load evicted).
A refusal is a 400 that carries SGLang's two fields beside the usual `error` object, and
nothing has changed then: the engine reads and checks an adapter completely before it serves it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import ApiError, error_body, json_response, read_json_body
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    parse_model,
)
from sglang_like.server.state import ServerState, get_state

router = APIRouter()

_MAX_NAME_CHARS = 256
_UPDATE_OK = json_content({"$ref": "#/components/schemas/LoraUpdateResponse"})
_NOT_ENABLED = "LoRA is not enabled on this server (start it with --enable-lora or --lora-paths)"


@router.post("/load_lora_adapter", openapi_extra=operation(
    body=LoadLoraAdapterRequest, ok=_UPDATE_OK, errors=(400, 401, 403)))
async def load_lora_adapter(request: Request) -> Response:
    """Read the PEFT adapter folder `lora_path` (on the server's disk) and serve it as
    `lora_name`; with --max-loaded-loras, the least recently used idle unpinned adapter makes
    room (named in `evicted`)."""
    state = get_state(request)
    try:
        body = parse_model(LoadLoraAdapterRequest, await read_json_body(request))
        load = _engine_method(state, "load_lora_adapter")
        name = _check_name(state, body.lora_name)
        # one update at a time: the engine checks names and room per call, and the names
        # this server resolves `model` against must follow the engine's order of updates
        async with state.lora_lock:
            # reading and fitting a big adapter takes seconds: on a worker thread, so the
            # event loop keeps streaming everyone's tokens meanwhile
            info = await _engine_call(load, name, body.lora_path, body.pinned)
            loaded = await _loaded_adapters(state)
    except ApiError as e:
        return _refusal(e)
    adapter = {k: v for k, v in info.items() if k != "evicted"}
    return json_response({"success": True, "error_message": None, "loaded_adapters": loaded,
                          "adapter": adapter, "evicted": list(info.get("evicted") or [])})


@router.post("/unload_lora_adapter", openapi_extra=operation(
    body=UnloadLoraAdapterRequest, ok=_UPDATE_OK, errors=(400, 401, 403)))
async def unload_lora_adapter(request: Request) -> Response:
    """Stop serving `lora_name`: requests already running on it finish on it (`adapter.
    in_flight` counts them); new requests naming it get a 400. An unknown name is a 400, as in
    SGLang."""
    state = get_state(request)
    try:
        body = parse_model(UnloadLoraAdapterRequest, await read_json_body(request))
        unload = _engine_method(state, "unload_lora_adapter")
        async with state.lora_lock:
            info = await _engine_call(unload, body.lora_name)
            loaded = await _loaded_adapters(state)
    except ApiError as e:
        return _refusal(e)
    return json_response({"success": True, "error_message": None, "loaded_adapters": loaded,
                          "adapter": info})


async def list_adapters(state: ServerState) -> list[dict[str, Any]]:
    """The engine's loaded adapters (name, path, rank, ...); none where LoRA is off."""
    lister = getattr(state.engine, "list_lora_adapters", None)
    if lister is None or not _lora_enabled(state):
        return []
    return list(await run_in_threadpool(lister))


def resolve_model(state: ServerState, model: str | None, lora_path: str | None
                  ) -> tuple[dict[str, Any], str]:
    """An OpenAI request's adapter, as Engine.generate keyword arguments (none: the base
    model), and the `model` its answer names.

    `model` is the served model's name (the base), a loaded adapter's name (vLLM), or
    `<served name>:<adapter>` (SGLang; the model path may stand for the served name). An
    adapter named after `base:` that is not loaded is a 404 naming it (vLLM's status for a
    model that does not exist). Any other name runs on the base model, as it did before
    adapters existed: clients send all sorts of names. SGLang's explicit `lora_path` field
    applies when `model` names no adapter."""
    adapter = _adapter_of(state, model)
    if adapter is not None:
        return {"lora_path": adapter}, str(model)
    if not lora_path:
        return {}, state.served_model_name
    require_lora(state)
    return {"lora_path": lora_path}, state.served_model_name


def require_lora(state: ServerState) -> None:
    """A request naming an adapter on a server without LoRA: a 400 here, before any work
    (and whatever the engine behind this server is)."""
    if not _lora_enabled(state):
        raise ApiError(400, _NOT_ENABLED, "lora_path")


def _adapter_of(state: ServerState, model: str | None) -> str | None:
    if not model or model == state.served_model_name:
        return None
    if model in state.lora_names:
        return model
    for base in (state.served_model_name, state.model_path):
        if model.startswith(base + ":"):
            adapter = model[len(base) + 1:].strip()
            if adapter and adapter not in state.lora_names:
                raise ApiError(404, f"The model `{model}` does not exist: no LoRA adapter "
                                    f"named {adapter!r} is loaded ({_loaded_text(state)})",
                               "model")
            return adapter or None
    return None


def _loaded_text(state: ServerState) -> str:
    if not _lora_enabled(state):
        return "LoRA is not enabled on this server"
    return "loaded: " + (", ".join(sorted(state.lora_names)) or "none")


def _lora_enabled(state: ServerState) -> bool:
    return bool(state.server_args.enable_lora or state.server_args.lora_paths)


def _engine_method(state: ServerState, name: str) -> Any:
    method = getattr(state.engine, name, None)
    if method is None or not _lora_enabled(state):
        raise ApiError(400, _NOT_ENABLED)
    return method


def _check_name(state: ServerState, name: str) -> str:
    """A name requests can use: printable, bounded, and not the base model's (a `model` of
    the served name always means the base)."""
    if not name or len(name) > _MAX_NAME_CHARS or not name.isprintable():
        raise ApiError(400, f"lora_name must be 1 to {_MAX_NAME_CHARS} printable characters",
                       "lora_name")
    if name == state.served_model_name:
        raise ApiError(400, f"lora_name {name!r} is the served model's own name; requests "
                            "naming it run on the base model", "lora_name")
    return name


async def _engine_call(method: Any, *args: Any) -> Any:
    """Run a LoRA method of the engine on a worker thread; its refusals (ValueError: a bad
    adapter, a name taken or unknown, no room) become a 400 with the engine's message."""
    try:
        return await run_in_threadpool(method, *args)
    except ValueError as e:  # in process or from the engine process (its client re-raises)
        raise ApiError(400, str(e) or type(e).__name__) from None


async def _loaded_adapters(state: ServerState) -> dict[str, str]:
    """SGLang's `loaded_adapters` (name -> path), after an update; also what `model` is
    resolved against from now on."""
    adapters = await list_adapters(state)
    state.lora_names.clear()
    state.lora_names.update(a["name"] for a in adapters)
    return {a["name"]: a["path"] for a in adapters}


def _refusal(e: ApiError) -> Response:
    """SGLang's failed-update answer (`success`: false, `error_message`) inside ours."""
    if e.status_code >= 500:
        raise e
    body = {**error_body(e.status_code, e.message, e.param), "success": False,
            "error_message": e.message}
    return json_response(body, status_code=e.status_code)
