"""The OpenAPI 3 document served at /openapi.json: request bodies are the pydantic models'
JSON schemas, responses are the shapes the routes really send (JSON, SSE, text, errors).

Routes read and validate their bodies themselves (`parse_model`: 400 with a message, never
FastAPI's 422), so FastAPI sees no body parameters; each route states its body and responses
with `openapi_extra=operation(...)`, and `install` puts the models' schemas into
`components.schemas`. Like every route but /health, the document needs the API key when the
server runs with --api-key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from sglang_like.server.protocol import (
    AbortRequest,
    CacheMatchRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    SwitchModeRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)

_REF = "#/components/schemas/{model}"
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    GenerateRequest, CompletionRequest, ChatCompletionRequest, AbortRequest, SwitchModeRequest,
    TokenizeRequest, DetokenizeRequest, CacheMatchRequest, LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
# Body models named by `operation(body=...)` outside protocol.py, by name (the routes' modules
# import this one, so it cannot import their models)
_ROUTE_BODY_MODELS: dict[str, type[BaseModel]] = {}
_ERROR_TEXT = {
    400: "Bad request: the body or a parameter is invalid (the message says which)",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    403: "Refused: the route or action needs the admin API key, or the server was not "
         "started allowing it, or a cross-origin page sent it",
    404: "Not found (the message says what)",
    429: "Too many requests waiting (--max-queued-requests); retry later",
    409: "Conflict: the server is busy with work that must finish first; retry",
    500: "A fault inside the runtime ended the request (`internal error: ...`); retry",
    503: "The server is not healthy (the message says why)",
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_OBJECT = {"type": "object"}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
        "prompt_tokens_details": _nullable(_OBJECT),
    },
}
_FINISH_REASON = {"enum": ["stop", "length", "abort", None]}
_GENERATE_RESULT = {
    "type": "object",
    "required": ["text", "meta_info"],
    "properties": {
        "text": _STR,
        "output_ids": {"type": "array", "items": _INT},
        "meta_info": {
            "type": "object",
            "required": ["id", "prompt_tokens", "completion_tokens", "finish_reason"],
            "properties": {
                "id": _STR, "prompt_tokens": _INT, "completion_tokens": _INT,
                "cached_tokens": _INT, "finish_reason": _nullable(_OBJECT),
            },
        },
    },
}
_COMPLETION_CHOICE = {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {
        "index": _INT, "text": _STR, "logprobs": _nullable(_OBJECT),
        "finish_reason": _FINISH_REASON,
    },
}
_CHAT_CHOICE = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": _INT,
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": _nullable(_STR)},
        },
        "logprobs": _nullable(_OBJECT),
        "finish_reason": _FINISH_REASON,
    },
}


_CHAT_DELTA_CHOICE = {
    "type": "object",
    "required": ["index", "delta", "finish_reason"],
    "properties": {
        "index": _INT,
        "delta": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                   "content": _nullable(_STR)}},
        "logprobs": _nullable(_OBJECT),
        "finish_reason": _FINISH_REASON,
    },
}


def _completion_like(
    kind: str, choice: dict[str, Any], *, is_chunk: bool = False
) -> dict[str, Any]:
    """A (chat) completion object; a stream chunk has usage only in its last, choice-less one."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices",
                     *([] if is_chunk else ["usage"])],
        "properties": {
            "id": _STR, "object": {"const": kind}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": choice}, "usage": _ref("Usage"),
        },
    }


# Response shapes; request shapes come from the pydantic models.
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": _STR, "type": _STR, "param": _nullable(_STR), "code": _INT,
                },
            }
        },
    },
    "Usage": _USAGE,
    "GenerateResult": _GENERATE_RESULT,
    "GenerateResponse": {
        "description": "One result; a list per prompt of a batch; a list of n results when n > 1",
        "anyOf": [
            _ref("GenerateResult"),
            {"type": "array", "items": _ref("GenerateResult")},
            {"type": "array", "items": {"type": "array", "items": _ref("GenerateResult")}},
        ],
    },
    "CompletionResponse": _completion_like("text_completion", _COMPLETION_CHOICE),
    "ChatCompletionResponse": _completion_like("chat.completion", _CHAT_CHOICE),
    "CompletionChunk": _completion_like("text_completion", _COMPLETION_CHOICE, is_chunk=True),
    "ChatCompletionChunk": _completion_like(
        "chat.completion.chunk", _CHAT_DELTA_CHOICE, is_chunk=True
    ),
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {"type": "object", "required": ["id", "object"],
                          "properties": {
                              "id": _STR, "object": {"const": "model"},
                              "root": {**_STR, "description": "the model path, or a LoRA "
                                                              "adapter's folder"},
                              "parent": {**_nullable(_STR), "description": "a LoRA "
                                         "adapter's base model; null for the base model"},
                          }},
            },
        },
    },
    "LoraUpdateResponse": {
        "type": "object",
        "description": "SGLang's answer (success, error_message, loaded_adapters: name -> "
                       "path) with the adapter's facts; a refusal is a 400 ErrorResponse that "
                       "also carries success: false and error_message",
        "required": ["success", "loaded_adapters"],
        "properties": {
            "success": {"type": "boolean"},
            "error_message": _nullable(_STR),
            "loaded_adapters": {"type": "object", "additionalProperties": _STR},
            "adapter": {
                "type": "object",
                "properties": {"name": _STR, "path": _STR, "rank": _INT, "alpha": {
                    "type": "number"}, "use_rslora": {"type": "boolean"}, "target_modules": {
                    "type": "array", "items": _STR}, "bytes": _INT, "pinned": {
                    "type": "boolean"}, "in_flight": {**_INT, "description": "requests "
                                                      "running on it (they finish on it)"}},
            },
            "evicted": {"type": "array", "items": _STR,
                        "description": "adapters unloaded to make room (--max-loaded-loras)"},
        },
    },
    "ServerInfo": {
        "type": "object",
        "required": ["kv_pool"],
        "properties": {
            "kv_pool": {
                "type": "object",
                "required": ["total_slots", "free_slots", "cached_slots", "used_slots"],
                "properties": {k: _INT for k in
                               ("total_slots", "free_slots", "cached_slots", "used_slots")},
            },
            "num_running_reqs": _INT,
            "num_queued_reqs": _INT,
        },
    },
    "TokenizerInfo": {
        "type": "object",
        "required": ["tokenizer_class", "eos_token", "model_max_length"],
        "properties": {
            "tokenizer_class": _STR, "model": _STR, "model_max_length": _INT, "vocab_size": _INT,
            **{k: _nullable(_STR) for k in ("bos_token", "eos_token", "pad_token", "unk_token",
                                            "chat_template")},
            "bos_token_id": _nullable(_INT),
            "eos_token_ids": {"type": "array", "items": _INT},
        },
    },
    "TokenizeResponse": {
        "type": "object",
        "description": "lists of lists (and of counts) when the prompt was a list",
        "required": ["tokens", "count", "max_model_len"],
        "properties": {
            "tokens": {"anyOf": [{"type": "array", "items": _INT},
                                 {"type": "array", "items": {"type": "array", "items": _INT}}]},
            "count": {"anyOf": [_INT, {"type": "array", "items": _INT}]},
            "max_model_len": _INT,
            "token_strs": {"type": "array"},
        },
    },
    "DetokenizeResponse": {
        "type": "object",
        "description": "the text twice: `prompt` (vLLM's name) and `text` (SGLang's)",
        "required": ["prompt", "text"],
        "properties": {
            "prompt": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
            "text": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        },
    },
    "Load": {
        "type": "object",
        "required": ["dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"],
        "properties": {
            "dp_rank": _INT,
            "num_reqs": {**_INT, "description": "running plus waiting requests"},
            "num_waiting_reqs": _INT,
            "num_tokens": {**_INT, "description": "KV slots the running requests hold"},
        },
    },
}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def sse_content(chunk_schema: str) -> dict[str, Any]:
    """A `text/event-stream` of `data: <chunk JSON>` events ending with `data: [DONE]`; a
    failure after the first event is one error event. The schema describes one event."""
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk_schema), _ref("ErrorResponse")]},
        },
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


TEXT_CONTENT = {"text/plain": {"schema": {"type": "string"}}}


def operation(
    *,
    body: type[BaseModel] | None = None,
    ok: dict[str, Any] | None = None,
    ok_description: str = "OK",
    errors: tuple[int, ...] = (401,),
) -> dict[str, Any]:
    """`openapi_extra` for one route: its request body (a model), its 200, its error codes.

    `ok` is the 200's `content` map (None: no body); every error is the JSON `ErrorResponse`.
    """
    responses: dict[str, Any] = {"200": {"description": ok_description}}
    if ok:
        responses["200"]["content"] = ok
    for code in errors:
        responses[str(code)] = {
            "description": _ERROR_TEXT[code], "content": json_content(_ref("ErrorResponse"))
        }
    extra: dict[str, Any] = {"responses": responses}
    if body is not None:
        # a route module's own body model (Anthropic's, Ollama's) is documented like ours
        _ROUTE_BODY_MODELS.setdefault(body.__name__, body)
        extra["requestBody"] = {
            "required": True, "content": json_content(_ref(body.__name__))
        }
    return extra


def component_schemas() -> dict[str, dict[str, Any]]:
    """The request models' schemas (their `$defs` lifted next to them) and the response shapes."""
    schemas: dict[str, dict[str, Any]] = {}
    extra_models = [m for m in _ROUTE_BODY_MODELS.values() if m not in _REQUEST_MODELS]
    for model in (*_REQUEST_MODELS, *extra_models):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(RESPONSE_SCHEMAS)
    return schemas


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (served at app.openapi_url) return the full document, built once."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(
                component_schemas()
            )
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
