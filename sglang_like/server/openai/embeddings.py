"""POST /v1/embeddings (OpenAI's) and POST /encode (SGLang's): the served model's final hidden
states pooled and L2-normalized (`Engine.encode`; --embedding-pooling last|mean). With
--is-embedding the server serves only these; without it they answer beside generation.

OpenAI's `encoding_format` "float" or "base64" (little-endian float32, what the official
client asks for by default) is honoured; `dimensions` only as the model's hidden size (no
Matryoshka truncation), and `user` is not acted on: both otherwise a 400 naming them.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.json_schemas import NonEmptyStr, TokenIds
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.openai.common import check_prompt_len
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import CacheSalt, parse_model
from sglang_like.server.runner import ClientGone
from sglang_like.server.state import get_state

router = APIRouter()

_MAX_INPUTS = 2048  # OpenAI's cap on one request's inputs


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid")

    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, description="only the model's hidden size")
    cache_salt: CacheSalt | None = None


class EncodeRequest(BaseModel):
    """POST /encode: SGLang's native embedding request."""

    model_config = ConfigDict(extra="forbid")

    text: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    image_data: Any = None
    pooling: Literal["last", "mean"] | None = None
    rid: str | list[str] | None = None
    cache_salt: CacheSalt | None = None


def _check_not_empty(value: Any, param: str) -> None:
    if isinstance(value, list) and (not value or any(isinstance(v, list) and not v
                                                     for v in value)):
        raise ApiError(400, f"{param} must not be empty (nor any of its token lists)", param)


def _prompt_kwargs(value: Any) -> dict[str, Any]:
    """`input` as Engine.encode takes it: text(s) as `prompt`, token ids as `input_ids`."""
    _check_not_empty(value, "input")
    if isinstance(value, str) or isinstance(value[0], str):
        return {"prompt": value}
    return {"input_ids": value}


def _count(kwargs: dict[str, Any]) -> int:
    value = kwargs.get("prompt", kwargs.get("input_ids"))
    return len(value) if isinstance(value, list) and not isinstance(value[0], int) else 1


@router.post("/v1/embeddings", openapi_extra=operation(
    body=EmbeddingRequest, ok=json_content({"type": "object"}), errors=(400, 401, 404, 429)))
async def embeddings(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(EmbeddingRequest, await read_json_body(request))
    if req.dimensions is not None and req.dimensions != (
            hidden := state.engine.model_config.hidden_size):
        raise ApiError(400, f"dimensions: this model's embeddings have {hidden} (truncating "
                            "them is not supported)", "dimensions")
    lora, model = resolve_model(state, req.model, None)
    kwargs = _prompt_kwargs(req.input)
    if _count(kwargs) > _MAX_INPUTS:
        raise ApiError(400, f"at most {_MAX_INPUTS} inputs a request", "input")
    texts = kwargs.get("prompt")
    if texts is not None:
        state.check_text_length(texts, "input")
    try:
        items = await _encode(state, request, {**kwargs, **lora, "cache_salt": req.cache_salt})
    except ClientGone:
        return Response(status_code=499)
    data = []
    for i, item in enumerate(items):
        vector = item["embedding"]
        data.append({"object": "embedding", "index": i, "embedding": vector
                     if req.encoding_format == "float" else base64.b64encode(
                         np.asarray(vector, dtype="<f4").tobytes()).decode()})
    tokens = sum(item["meta_info"]["prompt_tokens"] for item in items)
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@router.post("/encode", openapi_extra=operation(
    body=EncodeRequest, ok=json_content({"type": "object"}), errors=(400, 401, 429)))
async def encode(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(EncodeRequest, await read_json_body(request))
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "exactly one of `text` and `input_ids` must be given")
    _check_not_empty(req.input_ids, "input_ids")
    if req.text is not None:
        state.check_text_length(req.text, "text")
    kwargs = {"prompt": req.text, "input_ids": req.input_ids, "rid": req.rid,
              "cache_salt": req.cache_salt, "pooling": req.pooling}
    if req.image_data is not None:
        kwargs["image_data"] = req.image_data
    try:
        items = await _encode(state, request, kwargs)
    except ClientGone:
        return Response(status_code=499)
    batch = isinstance(req.text if req.text is not None else req.input_ids[0], list)
    return json_response(items if batch else items[0])


async def _encode(state: Any, request: Request, kwargs: dict[str, Any]) -> list[dict]:
    """Engine.encode's answers (one per input) through the runner (its in-flight accounting,
    disconnect watch and per-request hooks), as generate calls that generate nothing."""
    ids = kwargs.get("input_ids")
    if ids is not None:
        for one in ids if isinstance(ids[0], list) else [ids]:
            check_prompt_len(state, len(one))
    call = {**kwargs, "sampling_params": {"max_new_tokens": 0},
            "pooling": kwargs.get("pooling") or state.server_args.embedding_pooling}
    (result,) = await state.runner.generate(request, [call])
    items = result if isinstance(result, list) else [result]
    return [{"embedding": r["embedding"], "meta_info": r["meta_info"]} for r in items]
