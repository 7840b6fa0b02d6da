"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, a thin layer over
the chat path of /v1/chat/completions (its chat template, its tool plan, its sampling checks).

An Anthropic body is checked here, turned into the chat route's own ChatCompletionRequest
(system and text blocks -> messages, image blocks -> image_url parts, tool_use / tool_result
blocks -> tool calls and tool turns, tools and tool_choice -> OpenAI's), and the engine's
answer is turned back into Anthropic's content blocks, stop_reason and usage, or its SSE
events when streamed:

    message_start, ping, then per block: content_block_start, content_block_delta (text_delta
    or input_json_delta)..., content_block_stop; then message_delta (stop_reason, usage) and
    message_stop. A failure after the first event is one `error` event.

Fields this server would not act on (`thinking`, `metadata`, document blocks, server tools,
images for a text-only model, ...) are 400s naming them; `cache_control` is taken: the radix
cache keeps every prefix. Errors have Anthropic's shape:
{"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.function_call import ToolPlan
from sglang_like.server.chat_layer import (
    ChatPrompt,
    answer_refusals,
    chat_prompt,
    num_prompt_tokens,
    parse_body,
    raise_if_aborted,
)
from sglang_like.server.errors import ApiError, dumps, json_response, read_json_body
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.chat import tool_plan
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import ChatCompletionRequest, check_max_tokens, parse_model
from sglang_like.server.runner import EngineStream
from sglang_like.server.sse import open_streams, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error",
}
# Block types Anthropic has that this server does not serve, and why (a 400 says so).
_UNSERVED_BLOCKS = {
    "document": "documents are not served (images are, to a vision-language model)",
    "search_result": "search results are not served",
    "thinking": "the served model does not think",
    "redacted_thinking": "the served model does not think",
    "server_tool_use": "server tools are not served",
    "web_search_tool_result": "server tools are not served",
    "container_upload": "containers are not served",
}
_MAX_STOP_SEQUENCES = 16


# ---- request bodies --------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_CACHE_CONTROL = Field(None, description="accepted: the radix cache keeps every prefix anyway")


class AnthropicTextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = _CACHE_CONTROL
    # Anthropic's answers carry `citations: null`, and clients send the turn back as it came
    citations: list[Any] | None = Field(None, max_length=0, description="only null or empty: "
                                                                       "citations are not served")


class AnthropicToolUseBlock(_Strict):
    """A call the model made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = _CACHE_CONTROL


class AnthropicToolResultBlock(_Strict):
    """A tool's answer to the call `tool_use_id` (a user turn's block)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicTextBlock] = ""
    is_error: StrictBool = Field(False, description="the result is marked as an error to "
                                                    "the model")
    cache_control: dict[str, Any] | None = _CACHE_CONTROL

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class AnthropicBase64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1, description="the image file, base64")


class AnthropicUrlSource(_Strict):
    type: Literal["url"]
    url: str = Field(min_length=1, description="an http(s) URL the server fetches (or a "
                                               "local path under --allowed-local-media-path)")


class AnthropicImageBlock(_Strict):
    """An image for a vision-language model (a user turn's block)."""

    type: Literal["image"]
    source: Annotated[AnthropicBase64Source | AnthropicUrlSource, Field(discriminator="type")]
    cache_control: dict[str, Any] | None = _CACHE_CONTROL

    @property
    def url(self) -> str:
        """The image as the chat path's image_url takes it (base64 as a data: URL: bare
        base64 of a JPEG starts with "/", which would read as a path)."""
        source = self.source
        if isinstance(source, AnthropicUrlSource):
            return source.url
        return f"data:{source.media_type};base64,{source.data}"


_Block = Annotated[AnthropicTextBlock | AnthropicImageBlock | AnthropicToolUseBlock
                   | AnthropicToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class AnthropicTool(_Strict):
    """A client tool: the model calls it with arguments valid under `input_schema`."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = _CACHE_CONTROL


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='the tool to call (type "tool")')
    disable_parallel_tool_use: StrictBool = False


class AnthropicOutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the answer is generated "
                                                               "under this JSON Schema")


class AnthropicOutputConfig(_Strict):
    format: AnthropicOutputFormat | None = None


class AnthropicCountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """POST /v1/messages, Anthropic's body (the fields this server acts on)."""

    max_tokens: int = Field(ge=1, strict=True)
    cache_control: dict[str, Any] | None = _CACHE_CONTROL
    output_config: AnthropicOutputConfig | None = Field(
        None, description="structured outputs: format {type: json_schema, schema}")
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        None, max_length=_MAX_STOP_SEQUENCES)
    stream: StrictBool = False
    # sampling: Anthropic's older SDKs send these; the current one takes them in extra_body
    temperature: StrictFloat | None = Field(None, ge=0, le=1)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=1 << 30, strict=True)


def _check_unserved(body: Any) -> None:
    """400 for content blocks and tools of kinds this server does not serve, named by where
    they are (before the models' own, vaguer, union errors)."""
    if not isinstance(body, dict):
        return
    places: list[tuple[str, Any]] = []
    if isinstance(body.get("system"), list):
        places += [(f"system[{i}]", b) for i, b in enumerate(body["system"])]
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            places += [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(content)]
    for where, block in places:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in _UNSERVED_BLOCKS:
            raise ApiError(400, f"{where}: {kind} blocks are not supported: "
                                f"{_UNSERVED_BLOCKS[kind]}", where)
        if kind == "image" and where.startswith("system"):
            raise ApiError(400, f"{where}: the system prompt takes text blocks only; images go "
                                "in user turns", where)
        inner = block.get("content") if kind == "tool_result" else None
        for k, part in enumerate(inner if isinstance(inner, list) else []):
            if isinstance(part, dict) and part.get("type") != "text":
                raise ApiError(400, f"{where}.content[{k}]: a tool_result's content takes text "
                                    f"blocks only, not {part.get('type')!r}", where)
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ApiError(400, f"tools[{i}]: {kind!r} is one of Anthropic's server tools; only "
                                "client tools (name, description, input_schema) are served",
                           f"tools[{i}]")


# ---- to the chat route's request ---------------------------------------------------------------
def _text(content: str | list[AnthropicTextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _chat_messages(body: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """OpenAI chat messages: the system text first, a user turn's tool results as `tool`
    turns before its text, an assistant turn's tool_use blocks as its tool_calls."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts = [b.text for b in message.content if isinstance(b, AnthropicTextBlock)]
        uses = [b for b in message.content if isinstance(b, AnthropicToolUseBlock)]
        results = [b for b in message.content if isinstance(b, AnthropicToolResultBlock)]
        has_images = any(isinstance(b, AnthropicImageBlock) for b in message.content)
        if message.role == "user" and uses:
            raise ApiError(400, "tool_use blocks belong in assistant turns", "messages")
        if message.role == "assistant" and (results or has_images):
            kind = "tool_result" if results else "image"
            raise ApiError(400, f"{kind} blocks belong in user turns", "messages")
        out += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text}
                for r in results]
        if message.role == "assistant":
            calls = [{"id": u.id, "type": "function", "function": {
                "name": u.name, "arguments": json.dumps(u.input, ensure_ascii=False)}}
                for u in uses]
            out.append({"role": "assistant", "content": "".join(texts) or None,
                        **({"tool_calls": calls} if calls else {})})
        elif has_images:  # text and images in their order, as the chat path's parts
            out.append({"role": "user", "content": [
                {"type": "text", "text": b.text} if isinstance(b, AnthropicTextBlock) else
                {"type": "image_url", "image_url": {"url": b.url}}
                for b in message.content
                if isinstance(b, (AnthropicTextBlock, AnthropicImageBlock))]})
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _chat_tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, 'tool_choice of type "tool" needs the tool\'s name',
                           "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name is not None:
        raise ApiError(400, f'tool_choice.name goes with type "tool", not {choice.type!r}',
                       "tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_request(body: AnthropicCountTokensRequest) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in body.tools or []]
    chat: dict[str, Any] = {
        "model": body.model, "messages": _chat_messages(body),
        "tools": tools or None, "tool_choice": _chat_tool_choice(body.tool_choice),
    }
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    if isinstance(body, AnthropicMessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=body.top_p, top_k=body.top_k)
        output = body.output_config.format if body.output_config is not None else None
        if output is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"schema": output.schema_}}
    return parse_model(ChatCompletionRequest, chat)


async def _prompt(
    state: ServerState, body: AnthropicCountTokensRequest
) -> tuple[ChatCompletionRequest, ToolPlan | None, ChatPrompt]:
    """The chat request, its tool plan and its prompt."""
    req = _chat_request(body)
    plan = tool_plan(state, req)
    state.check_text_length([_content_text(m.content) for m in req.messages], "messages")
    return req, plan, await chat_prompt(state, req, plan, "image blocks")


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p.get("text"), str))
    return content or ""


# ---- routes ------------------------------------------------------------------------------------
def _error_schema() -> dict[str, Any]:
    anthropic = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}
    # the API-key and size checks before any route answer in the server's common shape
    return {"anyOf": [anthropic, {"$ref": "#/components/schemas/ErrorResponse"}]}


def _documented(body: type[BaseModel], ok: dict[str, Any]) -> dict[str, Any]:
    extra = operation(body=body, ok=ok, errors=())
    for code, text in ((400, "Bad request, or a field this server does not act on"),
                       (401, "Missing or wrong API key"), (404, "No such model or adapter"),
                       (429, "Too many requests waiting; retry later"),
                       (500, "A fault inside the runtime ended the request")):
        extra["responses"][str(code)] = {"description": text,
                                         "content": json_content(_error_schema())}
    return extra


_USAGE_SCHEMA = {"type": "object", "required": ["input_tokens", "output_tokens"],
                 "properties": {"input_tokens": {"type": "integer"},
                                "output_tokens": {"type": "integer"}}}
_MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "model": {"type": "string"},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "usage": _USAGE_SCHEMA,
    },
}
_EVENT_NAMES = ["message_start", "ping", "content_block_start", "content_block_delta",
                "content_block_stop", "message_delta", "message_stop", "error"]
_EVENTS = {"text/event-stream": {"schema": {
    "type": "object", "required": ["event", "data"],
    "description": "Anthropic's events (stream: true), in order: message_start, ping, "
                   "content_block_start / _delta / _stop per block, message_delta, "
                   "message_stop; or one `error` event. The schema describes one event.",
    "properties": {
        "event": {"enum": _EVENT_NAMES},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {
            "type": "object", "required": ["type"], "properties": {"type": {
                "enum": _EVENT_NAMES}}}},
    }}}}


@router.post("/messages", openapi_extra=_documented(
    AnthropicMessagesRequest, {**json_content(_MESSAGE_SCHEMA), **_EVENTS}))
async def create_message(request: Request) -> Response:
    """Anthropic's Messages API: one assistant turn, whole or as SSE events."""
    return await answer_refusals(_create_message, request, error_response)


@router.post("/messages/count_tokens", openapi_extra=_documented(
    AnthropicCountTokensRequest, json_content({
        "type": "object", "required": ["input_tokens"],
        "properties": {"input_tokens": {"type": "integer"}}})))
async def count_tokens(request: Request) -> Response:
    """The prompt's length in tokens, as /v1/messages would count it in usage.input_tokens."""
    try:
        state = get_state(request)
        raw = await read_json_body(request)
        _check_unserved(raw)
        body = parse_body(AnthropicCountTokensRequest, raw)
        resolve_model(state, body.model, None)
        _, _, prompt = await _prompt(state, body)
        num_tokens = await num_prompt_tokens(state, prompt)
    except ApiError as e:
        return error_response(e.status_code, e.message)
    return json_response({"input_tokens": num_tokens})


async def _create_message(request: Request) -> Response:
    state = get_state(request)
    raw = await read_json_body(request)
    _check_unserved(raw)
    body = parse_body(AnthropicMessagesRequest, raw)
    check_max_tokens(body.max_tokens, "max_tokens", state.context_length)
    lora, model = resolve_model(state, body.model, None)
    req, plan, prompt = await _prompt(state, body)
    sampling = req.sampling_dict(body.max_tokens)
    if plan is not None:
        try:
            sampling = plan.sampling_params(sampling)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
    call = {**prompt.engine_kwargs, "sampling_params": sampling, **lora}
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": model}
    stops = body.stop_sequences or []
    if body.stream:
        streams = await open_streams(state.runner, [call], request)
        events = _message_events(head, plan, stops, streams[0])
        return sse_response(events, streams, error_event=_error_event)
    (result,) = await state.runner.generate(request, [call])
    meta = result.get("meta_info") or {}
    raise_if_aborted(meta)
    text, calls = plan.read(result.get("text", "")) if plan is not None else (
        result.get("text", ""), [])
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name,
                 "input": json.loads(c.arguments)} for c in calls]
    stop_reason, stop_sequence = _stop_reason(meta, bool(calls), stops)
    return json_response({**head, "content": content, "stop_reason": stop_reason,
                          "stop_sequence": stop_sequence, "usage": _usage(meta)})


# ---- answers -----------------------------------------------------------------------------------
def error_response(status_code: int, message: str) -> Response:
    return json_response(_error_body(status_code, message), status_code=status_code)


def _error_body(status_code: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else
                            "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {dumps(data)}\n\n"


def _error_event(status_code: int, message: str) -> str:
    return _event("error", _error_body(status_code, message))


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(meta: dict[str, Any]) -> dict[str, int]:
    return {"input_tokens": int(meta.get("prompt_tokens", 0)),
            "output_tokens": int(meta.get("completion_tokens", 0))}


def _stop_reason(meta: dict[str, Any], has_tool_use: bool, stops: list[str]
                 ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): end_turn for the model's own end, stop_sequence for one
    of the request's stop_sequences, max_tokens, or tool_use when a call ended the turn."""
    reason = meta.get("finish_reason") or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    matched = reason.get("matched")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


class _BlockWriter:
    """Anthropic's content-block events from the chat path's deltas ({"content": text} and
    OpenAI-style {"tool_calls": [...]}, a call's first delta carrying its id and name)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.num_tool_uses = 0

    def write(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("content"):
            if self.kind != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                self.num_tool_uses += 1
                out += self._start({"type": "tool_use", "id": _tool_use_id(call["id"]),
                                    "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop",
                                              "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        out.append(_event("content_block_start", {"type": "content_block_start",
                                                  "index": self.index, "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self.index, "delta": delta})


async def _message_events(
    head: dict[str, Any], plan: ToolPlan | None, stops: list[str], stream: EngineStream,
) -> AsyncIterator[str]:
    # the stream opened on its first chunk, whose count of prompt tokens has every image's
    first = await anext(stream)
    num_input_tokens = int((first.get("meta_info") or {}).get("prompt_tokens", 0))
    yield _event("message_start", {"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": num_input_tokens, "output_tokens": 0}}})
    yield _event("ping", {"type": "ping"})
    reader = plan.stream() if plan is not None else None
    blocks = _BlockWriter()
    meta: dict[str, Any] = {}
    async for chunk in _prepend(first, stream):
        meta = chunk.get("meta_info") or meta
        text = chunk.get("text", "")
        finished = fmt.finish_reason(meta) is not None
        if reader is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = reader.feed(text) + (reader.finish() if finished else [])
        for delta in deltas:
            for event in blocks.write(delta):
                yield event
        if finished:
            break
    raise_if_aborted(meta)
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop_reason(meta, blocks.num_tool_uses > 0, stops)
    yield _event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": {"output_tokens": int(meta.get("completion_tokens", 0))}})
    yield _event("message_stop", {"type": "message_stop"})


async def _prepend(first: dict[str, Any], stream: EngineStream) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for chunk in stream:
        yield chunk
