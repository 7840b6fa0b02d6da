"""The tokenizer over HTTP: GET /tokenizer_info, POST /tokenize, POST /detokenize (also under
/v1), in the shapes vLLM serves and SGLang accepts; lm-eval's `tokenizer_backend=remote` (and
its auto-detection) counts tokens with them, so its context lengths are the server's own."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import (
    _MAX_PROMPTS,
    DetokenizeRequest,
    TokenizeRequest,
    parse_model,
)
from sglang_like.server.state import ServerState, get_state

router = APIRouter()


def _ok(schema_name: str) -> dict[str, Any]:
    return json_content({"$ref": f"#/components/schemas/{schema_name}"})


@router.get("/tokenizer_info", openapi_extra=operation(ok=_ok("TokenizerInfo")))
async def tokenizer_info(request: Request) -> Response:
    """What a client needs to tokenize as the server does (vLLM's /tokenizer_info)."""
    state = get_state(request)
    tok = state.tokenizer
    special = dict(getattr(tok, "special_tokens_map", {}) or {})
    bos_id = getattr(tok, "bos_token_id", None)
    return json_response({
        "tokenizer_class": type(tok).__name__,
        "model": state.served_model_name,
        "model_max_length": state.context_length,
        "vocab_size": tok.vocab_size,
        "bos_token": special.get("bos_token"),
        "eos_token": special.get("eos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
        "bos_token_id": bos_id,
        "eos_token_ids": sorted(getattr(tok, "eos_token_ids", ()) or ()),
        "chat_template": getattr(tok, "chat_template", None),
    })


def _options(fn: Any, **options: Any) -> dict[str, Any]:
    """The options `fn` takes: a minimal tokenizer (encode(text) / decode(ids), as the HTTP
    layer's test double has) takes none, and adds or skips no special tokens anyway."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in options.items() if k in params}


def _tokenize_one(state: ServerState, text: str, body: TokenizeRequest) -> list[int]:
    encode = state.tokenizer.encode
    ids = encode(text, **_options(encode, add_special_tokens=body.add_special_tokens))
    bos = getattr(state.tokenizer, "bos_token_id", None)
    if body.add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
        ids = ids[1:]  # a text that starts with the BOS gets it once, as the engine does
    return ids


@router.post("/tokenize", openapi_extra=operation(
    body=TokenizeRequest, ok=_ok("TokenizeResponse"), errors=(400, 401)))
@router.post("/v1/tokenize", openapi_extra=operation(
    body=TokenizeRequest, ok=_ok("TokenizeResponse"), errors=(400, 401)))
async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = parse_model(TokenizeRequest, await read_json_body(request))
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not texts or len(texts) > _MAX_PROMPTS:
        raise ApiError(400, f"prompt must be a string or 1 to {_MAX_PROMPTS} strings", "prompt")
    for text in texts:
        state.check_text_length(text)
    # on a worker thread: the event loop streams other requests' tokens meanwhile
    rows = await run_in_threadpool(lambda: [_tokenize_one(state, text, body) for text in texts])
    out: dict[str, Any] = {"max_model_len": state.context_length}
    if isinstance(body.prompt, str):
        out.update(tokens=rows[0], count=len(rows[0]))
    else:
        out.update(tokens=rows, count=[len(r) for r in rows])
    if body.return_token_strs:
        strs = [_token_strs(state.tokenizer, r) for r in rows]
        out["token_strs"] = strs[0] if isinstance(body.prompt, str) else strs
    return json_response(out)


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    return list(convert(ids)) if convert else [tokenizer.decode([i]) for i in ids]


@router.post("/detokenize", openapi_extra=operation(
    body=DetokenizeRequest, ok=_ok("DetokenizeResponse"), errors=(400, 401)))
@router.post("/v1/detokenize", openapi_extra=operation(
    body=DetokenizeRequest, ok=_ok("DetokenizeResponse"), errors=(400, 401)))
async def detokenize(request: Request) -> Response:
    state = get_state(request)
    body = parse_model(DetokenizeRequest, await read_json_body(request))
    is_batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows: list[list[int]] = body.tokens if is_batch else [body.tokens]  # type: ignore[list-item]
    vocab = state.tokenizer.vocab_size
    for row in rows:
        if any(not 0 <= t < vocab for t in row):
            raise ApiError(400, f"tokens must be integers in [0, {vocab})", "tokens")
    decode = state.tokenizer.decode
    options = _options(decode, skip_special_tokens=body.skip_special_tokens)
    texts = await run_in_threadpool(lambda: [decode(r, **options) for r in rows])
    text: str | list[str] = texts if is_batch else texts[0]
    # vLLM answers {"prompt"}, SGLang {"text"}: both, so clients of either read it
    return json_response({"prompt": text, "text": text})


__all__ = ["DetokenizeRequest", "TokenizeRequest", "router"]
