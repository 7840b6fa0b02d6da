"""Ollama's API: POST /api/chat and /api/generate (NDJSON streams by default, one JSON object
with "stream": false), GET /api/tags, POST /api/show, GET /api/version; a thin layer over the
chat path of /v1/chat/completions (its chat template, tool plan and sampling checks).

`options` map to sampling parameters (temperature, top_p, top_k, num_predict, stop, seed,
min_p, repeat_penalty, presence_penalty, frequency_penalty); unset ones take Ollama's
documented defaults (temperature 0.8, top_p 0.9, top_k 40; num_predict -1: until the context
is full). `format` ("json" or a JSON Schema) is the JSON-constrained decoding of
`response_format`; `tools` are the chat path's tools with tool_choice "auto". `images` (base64
files) go to a vision-language model before their message's text (generate's before the
prompt), as Ollama places them. What this server would not act on is a 400 naming it: images
for a text-only model, thinking, logprobs, a `template` or `suffix`, options such as num_ctx,
and a keep_alive other than "forever" (the model never unloads). Errors are Ollama's
{"error": "<message>"}.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import os
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.function_call import ToolPlan
from sglang_like.server.chat_layer import (
    ChatPrompt,
    answer_refusals,
    chat_prompt,
    parse_body,
    raise_if_aborted,
    refuse_images,
)
from sglang_like.server.errors import ApiError, dumps, json_response, read_json_body
from sglang_like.server.json_schemas import SAMPLING_RANGES, documented
from sglang_like.server.lora_api import list_adapters, resolve_model
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.chat import tool_plan
from sglang_like.server.openai.common import check_prompt_len
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import ChatCompletionRequest, check_max_tokens, parse_model
from sglang_like.server.runner import EngineStream
from sglang_like.server.sse import open_streams, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/api")

_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}  # Ollama's documented defaults
_TAG = ":latest"  # Ollama names carry a tag; the one model here has only this one
# keep_alive values that mean "keep the model loaded forever", which is what this server does
_FOREVER = re.compile(r"^-\d+(\.\d+)?(ns|us|µs|ms|s|m|h)?$")
_NDJSON = "application/x-ndjson"
_GGUF_TYPE = re.compile(r"\.(Q\d\w*|F16|F32|BF16|IQ\w+)\.gguf$", re.IGNORECASE)
# Ollama's images are bare base64; as data: URLs they cannot be read as paths (a JPEG's base64
# starts with "/"). The image's own bytes say its format.
_DATA_URL = "data:image/*;base64,"
_IMAGES = Field(None, description="images for a vision-language model: base64 of image files")


# ---- request bodies --------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _ranged(name: str) -> Any:
    return documented(None, **SAMPLING_RANGES[name])


class OllamaOptions(_Strict):
    """The runtime options this server acts on; any other (num_ctx, mirostat, ...) is a 400."""

    temperature: StrictFloat | None = _ranged("temperature")
    top_p: StrictFloat | None = _ranged("top_p")
    top_k: StrictInt | None = _ranged("top_k")
    num_predict: StrictInt | None = Field(
        None, description="tokens to generate; -1 or -2: until the context is full")
    stop: list[str] | str | None = None
    seed: StrictInt | None = _ranged("seed")
    min_p: StrictFloat | None = _ranged("min_p")
    repeat_penalty: StrictFloat | None = _ranged("repetition_penalty")
    presence_penalty: StrictFloat | None = _ranged("presence_penalty")
    frequency_penalty: StrictFloat | None = _ranged("frequency_penalty")


_Format = Literal["", "json"] | dict[str, Any] | None
_KeepAlive = Annotated[StrictFloat | StrictInt | str | None, Field(
    description="only values meaning forever (negative) are served: the model never unloads")]


class _OllamaCommon(_Strict):
    model: str = Field(min_length=1)
    format: _Format = Field(None, description='"json", or a JSON Schema the answer follows')
    options: OllamaOptions | None = None
    stream: StrictBool = True
    keep_alive: _KeepAlive = None
    think: StrictBool | str | None = Field(None, description="only false: the model does "
                                                             "not think")
    logprobs: StrictBool | None = Field(None, description="only false: not served here")
    top_logprobs: StrictInt | None = Field(None, description="only 0: not served here")


class OllamaToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any]
    index: StrictInt | None = None


class OllamaToolCall(_Strict):
    function: OllamaToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = _IMAGES
    thinking: str | None = Field(None, description="only empty: the model does not think")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class OllamaChatRequest(_OllamaCommon):
    """POST /api/chat (no messages: the model is loaded, done_reason "load")."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = Field(
        None, description='{"type": "function", "function": {name, description, parameters}}')


class OllamaGenerateRequest(_OllamaCommon):
    """POST /api/generate: a prompt through the chat template (or as-is with raw)."""

    prompt: str = ""
    images: list[str] | None = Field(None, description="images for a vision-language model "
                                     "(base64 of image files), placed before the prompt")
    system: str | None = None
    raw: StrictBool = False
    context: list[Annotated[int, Field(ge=0, strict=True)]] | None = Field(
        None, description="the `context` of an earlier answer: the conversation so far")
    suffix: str | None = Field(None, description="only empty: fill-in-the-middle is not served")
    template: str | None = Field(None, description="only empty: the model's own template is used")


class OllamaShowRequest(_Strict):
    model: str = Field(min_length=1)
    verbose: StrictBool | None = None


def _check_unserved(body: _OllamaCommon) -> None:
    """400 for values of Ollama's fields that ask for what this server cannot do."""
    unserved = {
        "think": body.think not in (None, False),
        "logprobs": body.logprobs,
        "top_logprobs": body.top_logprobs,
    }
    if isinstance(body, OllamaGenerateRequest):
        unserved.update(suffix=body.suffix, template=body.template,
                        system=body.system if body.raw else None)
    if isinstance(body, OllamaChatRequest):
        for i, message in enumerate(body.messages):
            unserved[f"messages[{i}].thinking"] = message.thinking
    for name, value in unserved.items():
        if value:
            why = _WHY[name.rsplit(".", 1)[-1]]
            raise ApiError(400, f"{name} is not supported by this server ({why})", name)
    keep = body.keep_alive
    if keep is not None and not (keep < 0 if isinstance(keep, (int, float))
                                 else bool(_FOREVER.match(keep.strip()))):
        raise ApiError(400, f"keep_alive {keep!r} is not supported: this server keeps its model "
                            "loaded forever (give a negative value, or none)", "keep_alive")


_WHY = {
    "thinking": "the served model does not think",
    "think": "the served model does not think",
    "logprobs": "not served on Ollama's routes; /v1/chat/completions has them",
    "top_logprobs": "not served on Ollama's routes; /v1/chat/completions has them",
    "suffix": "fill-in-the-middle is not served",
    "template": "the model's own chat template is used",
    "system": "raw prompts skip the template that would place it",
}


# ---- to the chat route's request ---------------------------------------------------------------
def _image_parts(images: list[str] | None, where: str) -> list[dict[str, Any]]:
    """Ollama's base64 images as the chat path's image_url parts (data: URLs)."""
    parts = []
    for j, data in enumerate(images or []):
        try:
            base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}[{j}] is not base64 (Ollama's images are base64 of "
                                "image files)", f"{where}[{j}]") from None
        parts.append({"type": "image_url", "image_url": {"url": _DATA_URL + data}})
    return parts


def _with_images(text: str, images: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content: its text, or with image parts the images first, then the text."""
    if not images:
        return text
    return images + ([{"type": "text", "text": text}] if text else [])


def _chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        images = _image_parts(message.images, f"messages[{i}].images")
        item: dict[str, Any] = {"role": message.role,
                                "content": _with_images(message.content, images)}
        if message.tool_calls:
            item["tool_calls"] = [{
                "id": c.id or f"call_{i}", "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for i, c in enumerate(message.tool_calls)]
        if message.tool_name:
            item["name"] = message.tool_name
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _chat_request(body: _OllamaCommon, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> ChatCompletionRequest:
    options = body.options or OllamaOptions()
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": tools or None,
        "temperature": _DEFAULTS["temperature"] if options.temperature is None
        else options.temperature,
        "top_p": _DEFAULTS["top_p"] if options.top_p is None else options.top_p,
        "top_k": _DEFAULTS["top_k"] if options.top_k is None else options.top_k,
        "stop": options.stop or None, "seed": options.seed, "min_p": options.min_p,
        "repetition_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
    }
    if body.format == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": body.format}}
    return parse_model(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


def _max_tokens(state: ServerState, options: OllamaOptions | None, prompt_len: int) -> int:
    num = options.num_predict if options is not None else None
    if num is None or num in (-1, -2):
        return max(1, state.context_length - prompt_len)
    if num < 1:
        raise ApiError(400, f"options.num_predict must be at least 1, or -1 / -2 (until the "
                            f"context is full), got {num}", "options.num_predict")
    check_max_tokens(num, "options.num_predict", state.context_length)
    return num


def _model_name(state: ServerState, name: str) -> tuple[dict[str, Any], str]:
    """(lora kwargs, the answer's model name) for an Ollama name (a `:latest` tag is ours)."""
    lora, model = resolve_model(state, name.removesuffix(_TAG), None)
    return lora, name if model == state.served_model_name else model


# ---- routes ------------------------------------------------------------------------------------
def _documented(body: type[BaseModel] | None, ok: dict[str, Any]) -> dict[str, Any]:
    extra = operation(body=body, ok=ok, errors=())
    error = {"anyOf": [{"type": "object", "required": ["error"], "properties": {
        "error": {"type": "string"}}}, {"$ref": "#/components/schemas/ErrorResponse"}]}
    for code in (400, 401, 404, 429, 500):
        extra["responses"][str(code)] = {"description": "Error (Ollama's shape; the API-key "
                                         "check's in the server's own)",
                                         "content": json_content(error)}
    return extra


_STREAMED = {_NDJSON: {"schema": {"type": "string", "description": "one JSON object a line; "
                                  "the last has done: true and the counts"}}}
_OBJECT = json_content({"type": "object"})


def _guarded(route: Any) -> Any:
    """Run a route, answering its refusals in Ollama's shape."""

    async def run(request: Request) -> Response:
        return await answer_refusals(route, request, _error_response)

    run.__name__ = route.__name__
    run.__doc__ = route.__doc__
    return run


async def chat(request: Request) -> Response:
    """Ollama's chat: the next assistant message, streamed as NDJSON unless stream is false."""
    state = get_state(request)
    body = parse_body(OllamaChatRequest, await read_json_body(request))
    _check_unserved(body)
    lora, model = _model_name(state, body.model)
    if not body.messages:
        return json_response({**_head(model), "message": {"role": "assistant", "content": ""},
                              "done_reason": "load", "done": True})
    for i, message in enumerate(body.messages):
        refuse_images(state, bool(message.images), f"messages[{i}].images",
                      f"messages[{i}].images")
    req = _chat_request(body, _chat_messages(body.messages), body.tools)
    plan = tool_plan(state, req)
    state.check_text_length([m.content for m in body.messages], "messages")
    prompt = await chat_prompt(state, req, plan, "images")
    return await _answer(request, state, _Job(model, req, plan, prompt, lora, body, "chat"))


async def generate(request: Request) -> Response:
    """Ollama's completion of one prompt (through the chat template unless raw)."""
    state = get_state(request)
    body = parse_body(OllamaGenerateRequest, await read_json_body(request))
    _check_unserved(body)
    lora, model = _model_name(state, body.model)
    if not body.prompt and not body.context and not body.images:
        return json_response({**_head(model), "response": "", "done_reason": "load",
                              "done": True})
    refuse_images(state, bool(body.images), "images", "images")
    if body.images and body.context:
        # context is token ids; an image reaches the model only through a text placeholder
        raise ApiError(400, "images cannot be combined with context (an answer about images "
                            "returns none): send the conversation to /api/chat instead",
                       "context")
    state.check_text_length([body.prompt, body.system or ""], "prompt")
    parts = _image_parts(body.images, "images")
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": _with_images(body.prompt, parts)}]
    req = _chat_request(body, messages, None)
    if body.raw:  # the images' placeholders before the prompt, as the template puts them
        images = [p["image_url"]["url"] for p in parts]
        placeholder = state.engine.image_prompter.placeholder if images else ""
        text = placeholder * len(images) + body.prompt
        input_ids = list(await run_in_threadpool(state.tokenizer.encode, text))
        prompt = ChatPrompt(text, input_ids, images)
    else:
        prompt = await chat_prompt(state, req, None, "images")
    if body.context:
        prompt = prompt._replace(input_ids=list(body.context) + prompt.input_ids)
    return await _answer(request, state, _Job(model, req, None, prompt, lora, body,
                                              "generate"))


router.add_api_route("/chat", _guarded(chat), methods=["POST"], openapi_extra=_documented(
    OllamaChatRequest, {**_OBJECT, **_STREAMED}))
router.add_api_route("/generate", _guarded(generate), methods=["POST"],
                     openapi_extra=_documented(OllamaGenerateRequest, {**_OBJECT, **_STREAMED}))


@router.get("/tags", openapi_extra=operation(ok=_OBJECT))
async def tags(request: Request) -> Response:
    """The served model and each loaded LoRA adapter, as Ollama lists local models."""
    state = get_state(request)
    names = [state.served_model_name] + [a["name"] for a in await list_adapters(state)]
    return json_response({"models": [{
        "name": name + _TAG, "model": name + _TAG, "modified_at": _modified_at(state),
        "size": _size_bytes(state.model_path), "details": _details(state)} for name in names]})


async def show(request: Request) -> Response:
    """A model's facts: its template, details, model_info and capabilities; 404 for a name that
    is neither the served model nor a loaded adapter."""
    state = get_state(request)
    body = parse_body(OllamaShowRequest, await read_json_body(request))
    name = body.model.removesuffix(_TAG)
    known = {state.served_model_name, state.model_path, *state.lora_names}
    if name not in known:
        raise ApiError(404, f"model {body.model!r} not found (served: "
                            f"{state.served_model_name}{_TAG})")
    details = _details(state)
    arch = details["family"]
    return json_response({
        "modelfile": "", "parameters": "",
        "template": getattr(state.tokenizer, "chat_template", None) or "",
        "details": details,
        "model_info": {"general.architecture": arch, "general.basename": name,
                       f"{arch}.context_length": state.context_length},
        "capabilities": ["completion", "tools"] + (
            ["vision"] if getattr(state.engine, "image_prompter", None) is not None else []),
        "modified_at": _modified_at(state),
    })


router.add_api_route("/show", _guarded(show), methods=["POST"],
                     openapi_extra=_documented(OllamaShowRequest, _OBJECT))


@router.get("/version", openapi_extra=operation(ok=_OBJECT))
async def version(request: Request) -> Response:
    """This server's version (not an Ollama version)."""
    return json_response({"version": request.app.version})


# ---- answers -----------------------------------------------------------------------------------
class _Job:
    """One chat or generate request, ready for the engine."""

    def __init__(self, model: str, req: ChatCompletionRequest, plan: ToolPlan | None,
                 prompt: ChatPrompt, lora: dict[str, Any], body: _OllamaCommon,
                 kind: Literal["chat", "generate"]) -> None:
        self.model, self.req, self.plan, self.prompt = model, req, plan, prompt
        self.lora, self.body, self.kind = lora, body, kind
        self.t0 = time.perf_counter_ns()

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.input_ids


async def _answer(request: Request, state: ServerState, job: _Job) -> Response:
    check_prompt_len(state, len(job.input_ids))
    sampling = job.req.sampling_dict(_max_tokens(state, job.body.options, len(job.input_ids)))
    if job.plan is not None:
        sampling = job.plan.sampling_params(sampling)
    call = {**job.prompt.engine_kwargs, "sampling_params": sampling, **job.lora}
    if job.body.stream:
        streams = await open_streams(state.runner, [call], request)
        return sse_response(_lines(job, streams[0]), streams, error_event=_error_line,
                            media_type=_NDJSON)
    (result,) = await state.runner.generate(request, [call])
    meta = result.get("meta_info") or {}
    raise_if_aborted(meta)
    text = result.get("text", "")
    out = {**_head(job.model), **_final(job, meta, list(result.get("output_ids") or []))}
    if job.kind == "generate":
        out["response"] = text
    else:
        content, calls = job.plan.read(text) if job.plan is not None else (text, [])
        out["message"] = {"role": "assistant", "content": content or ""}
        if calls:
            out["message"]["tool_calls"] = [_ollama_call(c.name, c.arguments) for c in calls]
    out["total_duration"] = time.perf_counter_ns() - job.t0
    return json_response(out)


async def _lines(job: _Job, stream: EngineStream) -> AsyncIterator[str]:
    """NDJSON: a line per piece of text (or tool call), then the final line with the counts."""
    t_first = time.perf_counter_ns()  # the stream opened on its first chunk: the prompt's done
    reader = job.plan.stream() if job.plan is not None else None
    meta: dict[str, Any] = {}
    output_ids: list[int] = []
    async for chunk in stream:
        meta = chunk.get("meta_info") or meta
        output_ids += chunk.get("output_ids") or []
        text = chunk.get("text", "")
        finished = fmt.finish_reason(meta) is not None
        if reader is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = reader.feed(text) + (reader.finish() if finished else [])
        for delta in deltas:
            yield _line({**_head(job.model), **_piece(job, delta), "done": False})
        if finished:
            break
    raise_if_aborted(meta)
    now = time.perf_counter_ns()
    last = {**_head(job.model), **_final(job, meta, output_ids),
            "total_duration": now - job.t0, "prompt_eval_duration": t_first - job.t0,
            "eval_duration": now - t_first}
    if job.kind == "generate":
        last["response"] = ""
    else:
        last["message"] = {"role": "assistant", "content": ""}
    yield _line(last)


def _piece(job: _Job, delta: dict[str, Any]) -> dict[str, Any]:
    if job.kind == "generate":
        return {"response": delta.get("content", "")}
    message: dict[str, Any] = {"role": "assistant", "content": delta.get("content", "")}
    calls = [c["function"] for c in delta.get("tool_calls") or []]
    if calls:
        message["tool_calls"] = [_ollama_call(c["name"], c["arguments"]) for c in calls]
    return {"message": message}


def _final(job: _Job, meta: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    reason = (meta.get("finish_reason") or {}).get("type")
    out: dict[str, Any] = {
        "done": True, "done_reason": "length" if reason == "length" else "stop",
        "load_duration": 0,  # the model is loaded at start and never unloads
        "prompt_eval_count": int(meta.get("prompt_tokens", 0)),
        "eval_count": int(meta.get("completion_tokens", 0)),
    }
    if job.kind == "generate" and not job.prompt.images:
        # with images the ids hold placeholders their pictures would not come back to
        out["context"] = job.input_ids + output_ids
    return out


def _ollama_call(name: str, arguments: str) -> dict[str, Any]:
    return {"function": {"name": name, "arguments": json.loads(arguments)}}


def _head(model: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"model": model, "created_at": now.isoformat().replace("+00:00", "Z")}


def _line(obj: dict[str, Any]) -> str:
    return dumps(obj) + "\n"


def _error_line(status_code: int, message: str) -> str:
    return _line({"error": message})


def _error_response(status_code: int, message: str) -> Response:
    return json_response({"error": message}, status_code=status_code)


def _details(state: ServerState) -> dict[str, Any]:
    arch = getattr(getattr(state.engine, "model_config", None), "architecture", None) or "llama"
    path = state.model_path
    level = state.server_args.quantization
    if level == "auto":  # a GGUF's type is in its name (model.Q4_1.gguf); else what auto picks
        found = _GGUF_TYPE.search(path)
        level = found.group(1) if found else "auto"
    return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": arch, "families": [arch], "quantization_level": level}


def _size_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if os.path.isfile(os.path.join(path, f)))
    return 0


def _modified_at(state: ServerState) -> str:
    path = state.model_path
    stamp = os.path.getmtime(path) if os.path.exists(path) else 0.0
    when = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
    return when.isoformat().replace("+00:00", "Z")
