"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, a thin layer
over the chat path of /v1/chat/completions (its chat template, tool plan, reasoning plan and
sampling checks).

A body is checked here and turned into the chat route's own ChatCompletionRequest
(`instructions` -> a system turn first; message items -> turns, their input_image parts ->
image_url parts for a vision-language model; function_call items -> the
assistant turn's tool_calls; function_call_output items -> tool turns; a reasoning item -> the
next assistant turn's reasoning_content; function tools, tool_choice and text.format -> chat's
tools, tool_choice and response_format). The answer becomes output items (reasoning, message,
function_call), whole or as the SSE events the official SDK reads, each with a sequence_number:

    response.created, response.in_progress, then per item response.output_item.added,
    [response.content_part.added, response.output_text.delta (reasoning_text.delta for a
    reasoning item)..., response.output_text.done, response.content_part.done] or
    [response.function_call_arguments.delta..., response.function_call_arguments.done],
    response.output_item.done; last response.completed, or response.incomplete when
    max_output_tokens cut the answer. A failure after the first event: error, response.failed.

Responses are kept (store: true, the default) in a bounded LRU in memory, per app and per
tenant: GET and DELETE reach them, and `previous_response_id` continues one (its input and
output items come before the new input; its instructions are not carried, as OpenAI does).
What the server would not act on (background, include, built-in tools, truncation "auto",
reasoning settings, images for a text-only model, ...) is a 400 naming it. Errors have the
other /v1 routes' OpenAI shape.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    TypeAdapter,
)
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.function_call import ToolPlan
from sglang_like.server.anthropic_api import (
    ChatPrompt,
    chat_prompt,
    parse_body,
    raise_if_aborted,
    refuse_images,
)
from sglang_like.server.auth import principal_of
from sglang_like.server.errors import ApiError, dumps, json_response, read_json_body
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.chat import tool_plan
from sglang_like.server.openai.reasoning import (
    BudgetStream,
    ReasoningPlan,
    generate_with_budget,
)
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import ChatCompletionRequest, check_max_tokens, parse_model
from sglang_like.server.runner import EngineStream
from sglang_like.server.sse import open_streams, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20  # the kept conversations' JSON text, summed per response
_SERVED_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
_UNSERVED_PARTS = {
    "input_file": "files are not served (images are, to a vision-language model)",
    "input_audio": "the served model reads text only",
    "refusal": "refusal parts are not served",
}


# ---- request bodies --------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_ItemStatus = Literal["in_progress", "completed", "incomplete"] | None


class ResponsesInputText(_Strict):
    type: Literal["input_text"]
    text: str


class ResponsesOutputText(_Strict):
    """An earlier answer's text, as this server writes it (clients send output items back)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list, max_length=0,
                                   description="only empty: annotations are not served")
    logprobs: list[Any] | None = Field(None, max_length=0, description="only empty")


class ResponsesInputImage(_Strict):
    """An image for a vision-language model."""

    type: Literal["input_image"]
    image_url: str | None = Field(None, description="a data: or http(s) URL (or a local path "
                                                    "under --allowed-local-media-path)")
    detail: Literal["auto", "low", "high"] = Field("auto", description="only auto: the "
                                                   "model's own preprocessing sizes the image")
    file_id: str | None = Field(None, description="only null: the Files API is not served")


_ContentPart = Annotated[ResponsesInputText | ResponsesOutputText | ResponsesInputImage,
                         Field(discriminator="type")]


class ResponsesMessageItem(_Strict):
    """A turn: `type` may be left out (OpenAI's easy input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_ContentPart]
    id: str | None = None
    status: _ItemStatus = None


class ResponsesFunctionCall(_Strict):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: _ItemStatus = None


class ResponsesFunctionCallOutput(_Strict):
    """The result of the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ResponsesInputText]
    id: str | None = None
    status: _ItemStatus = None


class ResponsesReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ResponsesSummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ResponsesReasoningItem(_Strict):
    """Earlier reasoning: handed to the chat template as the next assistant turn's
    reasoning_content (templates of thinking models decide whether to show it)."""

    type: Literal["reasoning"]
    summary: list[ResponsesSummaryText] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    id: str | None = None
    status: _ItemStatus = None


def _item_kind(value: Any) -> Any:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


ResponsesItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCall, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
_ITEM = TypeAdapter(ResponsesItem)


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = Field(None, description="true: calls are generated under "
                                      "`parameters` (a 400 where the server would not hold "
                                      "them: tool_choice auto without a structural tag)")


class ResponsesToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormatText(_Strict):
    type: Literal["text"]


class ResponsesTextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponsesTextFormatJsonSchema(_Strict):
    """The answer is generated under `schema` (strict or not: it is always held to it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponsesTextConfig(_Strict):
    format: Annotated[
        ResponsesTextFormatText | ResponsesTextFormatJsonObject | ResponsesTextFormatJsonSchema,
        Field(discriminator="type"),
    ] | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses (the fields this server acts on)."""

    model: str = Field(min_length=1)
    input: str | list[ResponsesItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponsesTextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = Field(True, description="keep the response for GET and "
                                                "previous_response_id")
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="echoed in the response, and kept with it")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description='only "disabled": a conversation longer than the context is a 400')
    background: StrictBool | None = Field(None, description="only false")
    include: list[str] | None = Field(None, description="only empty")


def _check_unserved(body: Any) -> None:
    """400 for items, content parts, tools and tool choices of kinds this server does not
    serve, named by where they are (before the models' own, vaguer, union errors)."""
    if not isinstance(body, dict):
        return
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if isinstance(kind, str) and kind not in _SERVED_ITEMS:
            why = ("send previous_response_id to continue a kept response"
                   if kind == "item_reference" else
                   "only message, function_call, function_call_output and reasoning items")
            raise ApiError(400, f"input[{i}]: {kind} items are not supported ({why})",
                           f"input[{i}]")
        for key in ("content", "output"):
            parts = item.get(key)
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"input[{i}].{key}[{j}]"
                if isinstance(kind, str) and kind in _UNSERVED_PARTS:
                    raise ApiError(400, f"{where}: {kind} parts are not supported: "
                                        f"{_UNSERVED_PARTS[kind]}", where)
                if kind == "input_image":
                    _check_image(part, where, key == "output" or item.get("role") == "assistant")
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ApiError(400, f"tools[{i}]: {kind!r} is a built-in tool of OpenAI's; only "
                                "function tools are served", f"tools[{i}]")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise ApiError(400, f"tool_choice of type {kind!r} is not supported: only \"none\", "
                            "\"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")


def _check_image(part: dict[str, Any], where: str, is_misplaced: bool) -> None:
    if is_misplaced:
        raise ApiError(400, f"{where}: input_image parts go in user, system or developer "
                            "messages", where)
    if part.get("file_id") is not None:
        raise ApiError(400, f"{where}.file_id: the Files API is not served; send the image as "
                            "image_url (a data: or http(s) URL)", f"{where}.file_id")
    if not isinstance(part.get("image_url"), str) or not part["image_url"]:
        raise ApiError(400, f"{where}: an input_image needs image_url (a data: or http(s) URL)",
                       f"{where}.image_url")
    if part.get("detail", "auto") != "auto":
        # OpenAI's low/high pick its own tiling; here the model's processor decides
        raise ApiError(400, f"{where}.detail: only auto is served (the model's own "
                            "preprocessing sizes the image)", f"{where}.detail")


def _check_values(body: ResponsesRequest) -> None:
    """400 for values of accepted fields that ask for what this server does not do."""
    if body.background:
        raise ApiError(400, "background is not supported: a response is generated while its "
                            "request waits", "background")
    if body.include:
        raise ApiError(400, f"include is not supported ({body.include[0]!r}): no optional "
                            "output fields are served", "include")
    if body.truncation == "auto":
        raise ApiError(400, 'truncation "auto" is not supported: input longer than the '
                            'context is a 400 ("disabled")', "truncation")


# ---- to the chat route's request ---------------------------------------------------------------
def _text(content: str | Sequence[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _has_images(items: Sequence[Any]) -> bool:
    return any(isinstance(p, ResponsesInputImage) for item in items
               if isinstance(item, ResponsesMessageItem) and not isinstance(item.content, str)
               for p in item.content)


def _content(content: str | Sequence[Any]) -> str | list[dict[str, Any]]:
    """A message's content for the chat path: its text, or with images the chat path's text
    and image_url parts in their order."""
    if not any(isinstance(p, ResponsesInputImage) for p in content if not isinstance(p, str)):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, ResponsesInputImage) else {"type": "text", "text": p.text}
            for p in content]


def _input_items(body: ResponsesRequest) -> list[Any]:
    if isinstance(body.input, str):
        return [ResponsesMessageItem(role="user", content=body.input)]
    return list(body.input)


def _chat_messages(items: Sequence[Any], num_kept: int) -> list[dict[str, Any]]:
    """OpenAI chat messages of a conversation's items (the first `num_kept` from a previous
    response, already checked): a call joins the assistant turn it follows, a reasoning item
    goes to the next assistant turn."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, ResponsesReasoningItem):
            reasoning = _text(item.content if item.content is not None else item.summary)
            continue
        if isinstance(item, ResponsesFunctionCallOutput):
            if item.call_id not in call_ids:
                where = f"input[{i - num_kept}]"
                raise ApiError(400, f"{where}: no function_call item before it has call_id "
                                    f"{item.call_id!r}", where)
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
            reasoning = None  # it belonged to a turn that had no assistant item
            continue
        if isinstance(item, ResponsesFunctionCall):
            call_ids.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            turn = {"role": item.role, "content": _content(item.content)}
        if turn["role"] == "assistant" and reasoning is not None:
            turn["reasoning_content"] = reasoning
        reasoning = None
        out.append(turn)
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, ResponsesToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: ResponsesTextConfig | None) -> dict[str, Any] | None:
    form = text.format if text is not None else None
    if isinstance(form, ResponsesTextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(form, ResponsesTextFormatJsonSchema):
        return {"type": "json_schema", "json_schema": {"name": form.name, "schema": form.schema_,
                                                       "strict": form.strict}}
    return None


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]
                  ) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description or "", "parameters": t.parameters}}
        for t in body.tools or []]
    chat = {
        "model": body.model, "messages": messages, "tools": tools or None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature,
        "top_p": body.top_p, "response_format": _response_format(body.text),
    }
    return parse_model(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


def _prompt_texts(messages: list[dict[str, Any]]) -> list[str]:
    texts = [p.get("text", "") for m in messages if isinstance(m.get("content"), list)
             for p in m["content"]]
    texts += [m.get("content") or "" for m in messages if not isinstance(m.get("content"), list)]
    texts += [m.get("reasoning_content") or "" for m in messages]
    return texts + [c["function"]["arguments"] for m in messages for c in m.get("tool_calls", [])]


def _check_strict(body: ResponsesRequest, plan: ToolPlan, sampling: dict[str, Any]) -> None:
    """A tool with strict: true needs its calls held to its schema: a named or required
    choice always is; auto only under the parser's structural tag (xgrammar, no text.format)."""
    if plan.choice.mode != "auto" or "structural_tag" in sampling:
        return
    for i, tool in enumerate(body.tools or []):
        if tool.strict:
            raise ApiError(400, f"tools[{i}].strict: with tool_choice auto this server holds "
                                "calls to their schemas only under its structural tag (the "
                                "xgrammar backend, no text.format); send strict: false, or "
                                "tool_choice required or a named function",
                           f"tools[{i}].strict")


# ---- the kept responses ------------------------------------------------------------------------
@dataclass(frozen=True)
class KeptResponse:
    owner: str | None  # the tenant that made it: no other may read it
    response: dict[str, Any]
    conversation: tuple[Any, ...]  # the items a next turn continues from (input + output)
    num_chars: int


class ResponseStore:
    """Responses kept for GET and previous_response_id. The least recently used are dropped
    once there are more than `max_responses`, or once the kept conversations pass `max_chars`
    (counted per response, so a conversation's earlier turns count again in each response
    that continues it: the memory stays under the cap)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, kept: KeptResponse) -> None:
        self.delete(kept.owner, response_id)
        self._kept[response_id] = kept
        self.num_chars += kept.num_chars
        while len(self._kept) > self.max_responses or (
                self.num_chars > self.max_chars and len(self._kept) > 1):
            _, dropped = self._kept.popitem(last=False)
            self.num_chars -= dropped.num_chars

    def get(self, owner: str | None, response_id: str) -> KeptResponse | None:
        kept = self._kept.get(response_id)
        if kept is None or kept.owner != owner:
            return None
        self._kept.move_to_end(response_id)
        return kept

    def delete(self, owner: str | None, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        self.num_chars -= self._kept.pop(response_id).num_chars
        return True


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use (an app serves one engine, one store)."""
    state = request.app.state
    store = getattr(state, "responses_store", None)
    if store is None:
        store = state.responses_store = ResponseStore()
    return store


def _find(request: Request, response_id: str, param: str | None = None) -> KeptResponse:
    kept = response_store(request).get(principal_of(request.scope).tenant, response_id)
    if kept is None:
        raise ApiError(404, f"response {response_id!r} not found (made with store: false, "
                            "deleted, or dropped from the server's memory)", param)
    return kept


# ---- routes ------------------------------------------------------------------------------------
_STR, _INT = {"type": "string"}, {"type": "integer"}
_ITEM_SCHEMA = {"type": "object", "required": ["type"], "properties": {"type": {
    "enum": ["message", "function_call", "reasoning"]}, "id": _STR}}
_RESPONSE_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": _STR, "object": {"const": "response"}, "created_at": _INT,
        "status": {"enum": ["completed", "incomplete"]}, "model": _STR,
        "output": {"type": "array", "items": _ITEM_SCHEMA},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens",
                                                 "total_tokens"],
                  "properties": {"input_tokens": _INT, "output_tokens": _INT,
                                 "total_tokens": _INT}},
    },
}
_EVENTS = {"text/event-stream": {"schema": {
    "type": "object", "required": ["event", "data"],
    "description": "The Responses API's events (stream: true), each with a sequence_number: "
                   "response.created, response.in_progress, the output items' events, then "
                   "response.completed or response.incomplete; or error and response.failed. "
                   "The schema describes one event.",
    "properties": {"event": _STR, "data": {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": {"type": "object", "required": ["type", "sequence_number"]}}},
}}}
_ERRORS = (400, 401, 404, 429, 500)


@router.post("/responses", openapi_extra=operation(
    body=ResponsesRequest, ok={**json_content(_RESPONSE_SCHEMA), **_EVENTS}, errors=_ERRORS))
async def create_response(request: Request) -> Response:
    """One model response: output items whole, or the Responses API's SSE events."""
    state = get_state(request)
    raw = await read_json_body(request)
    _check_unserved(raw)
    body = parse_body(ResponsesRequest, raw)
    _check_values(body)
    check_max_tokens(body.max_output_tokens, "max_output_tokens", state.context_length)
    lora, model = resolve_model(state, body.model, None)
    kept: tuple[Any, ...] = ()
    if body.previous_response_id is not None:
        kept = _find(request, body.previous_response_id, "previous_response_id").conversation
    job = await _Job.build(state, body, kept)
    job.owner = principal_of(request.scope).tenant
    job.store = response_store(request) if body.store else None
    out = _Output(_head(body, model))
    sampling = job.sampling_params(state)
    budget = job.thinking if job.thinking is not None and job.thinking.has_budget else None
    if budget is not None and job.prompt.images:
        raise ApiError(400, "a thinking budget does not take images yet", "input")
    base = {**job.prompt.engine_kwargs, **lora}
    if body.stream:
        call = {**base, "sampling_params": sampling}
        if budget is not None:
            call["sampling_params"] = {**sampling, "max_new_tokens": budget.first_max_tokens(
                sampling["max_new_tokens"])}
        streams: list[Any] = await open_streams(state.runner, [call], request)
        if budget is not None:
            streams = [BudgetStream(state.runner, streams[0], call, job.owner, budget,
                                    state.tokenizer, sampling["max_new_tokens"])]
        return sse_response(_events(job, out, streams[0]), streams, error_event=out.failed)
    if budget is not None:
        (result,) = await generate_with_budget(state.runner, request, base, sampling, 1,
                                               budget, state.tokenizer)
    else:
        (result,) = await state.runner.generate(request, [{**base, "sampling_params": sampling}])
    meta = result.get("meta_info") or {}
    raise_if_aborted(meta)
    job.write_whole(out, result.get("text", ""))
    out.finish(meta, job.num_reasoning_tokens(out))
    job.keep(out.response, out.items)
    return json_response(out.response)


@router.get("/responses/{response_id}", openapi_extra=operation(
    ok=json_content(_RESPONSE_SCHEMA), errors=(400, 401, 404)))
async def retrieve_response(request: Request, response_id: str) -> Response:
    """A kept response, as it was answered."""
    _check_no_query(request)
    return json_response(_find(request, response_id).response)


@router.delete("/responses/{response_id}", openapi_extra=operation(ok=json_content({
    "type": "object", "required": ["id", "object", "deleted"],
    "properties": {"id": _STR, "object": {"const": "response"}, "deleted": {"const": True}}}),
    errors=(400, 401, 404)))
async def delete_response(request: Request, response_id: str) -> Response:
    """Forget a kept response (later previous_response_id naming it is a 404)."""
    _check_no_query(request)
    _find(request, response_id)
    response_store(request).delete(principal_of(request.scope).tenant, response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _check_no_query(request: Request) -> None:
    """GET's stream / include / starting_after would replay or extend an answer: not served."""
    names = list(request.query_params)
    if names:
        raise ApiError(400, f"query parameter {names[0]!r} is not supported", names[0])


# ---- answers -----------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _head(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object before any output (echoing the request as OpenAI does)."""
    form = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "id": _new_id("resp"), "object": "response", "created_at": fmt.now(),
        "status": "in_progress", "background": False, "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": form.model_dump(by_alias=True, exclude_none=True)
                 if form is not None else {"type": "text"}},
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        "tools": [t.model_dump() for t in body.tools or []],
        "truncation": "disabled", "metadata": body.metadata or {}, "usage": None,
    }


class _Job:
    """One request, ready for the engine: its chat request, plans, prompt and conversation."""

    def __init__(self, body: ResponsesRequest, req: ChatCompletionRequest,
                 plan: ToolPlan | None, thinking: ReasoningPlan | None, prompt: ChatPrompt,
                 conversation: tuple[Any, ...], tokenizer: Any) -> None:
        self.body, self.req, self.plan, self.thinking = body, req, plan, thinking
        self.prompt, self.conversation, self.tokenizer = prompt, conversation, tokenizer
        self.store: ResponseStore | None = None
        self.owner: str | None = None

    @classmethod
    async def build(cls, state: ServerState, body: ResponsesRequest,
                    kept: tuple[Any, ...]) -> _Job:
        conversation = (*kept, *_input_items(body))
        # before any image is fetched or the template sees an image part
        refuse_images(state, _has_images(conversation), "input_image parts", "input")
        messages = _chat_messages(conversation, len(kept))
        if body.instructions is not None:
            messages.insert(0, {"role": "system", "content": body.instructions})
        if not messages:
            raise ApiError(400, "input is empty and there are no instructions", "input")
        state.check_text_length(_prompt_texts(messages), "input")
        req = _chat_request(body, messages)
        plan = tool_plan(state, req)
        prompt = await chat_prompt(state, req, plan, "input_image parts")
        thinking = None
        args = state.server_args
        if args.reasoning_parser is not None:
            # the plan reads whether the rendered prompt left a think block open
            thinking = ReasoningPlan.build(args.reasoning_parser, args.reasoning_budget, req,
                                           prompt.text)
        return cls(body, req, plan, thinking, prompt, conversation, state.tokenizer)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.input_ids

    def sampling_params(self, state: ServerState) -> dict[str, Any]:
        max_tokens = self.body.max_output_tokens or max(
            1, state.context_length - len(self.input_ids))
        sampling = self.req.sampling_dict(max_tokens)
        if self.plan is not None:
            try:
                sampling = self.plan.sampling_params(sampling)
            except ValueError as e:
                raise ApiError(400, str(e), "tool_choice") from None
            _check_strict(self.body, self.plan, sampling)
        if self.thinking is not None:  # a schema or tool format goes after the think block
            self.thinking, sampling = self.thinking.constrain(
                sampling, state.server_args.grammar_backend)
        return sampling

    def write_whole(self, out: _Output, text: str) -> None:
        """A whole answer's items: reasoning, then text, then calls (as the chat route reads
        them: an answer that is not a complete call is text)."""
        reasoning, content = self.thinking.split(text) if self.thinking is not None else (
            None, text)
        calls: list[Any] = []
        if self.plan is not None:
            content, calls = self.plan.read(content)
        if reasoning:
            out.reasoning(reasoning)
        if content:
            out.text(content)
        for call in calls:
            out.call(call.id, call.name)
            out.arguments(call.arguments)

    def num_reasoning_tokens(self, out: _Output) -> int:
        """The reasoning's tokens, counted by encoding its text (markers not included)."""
        text = "".join(p["text"] for item in out.items if item["type"] == "reasoning"
                       for p in item["content"])
        return len(self.tokenizer.encode(text)) if text else 0

    def keep(self, response: dict[str, Any], output: list[dict[str, Any]]) -> None:
        """Keep a finished response (store: true) for GET and previous_response_id."""
        if self.store is None:
            return
        conversation = (*self.conversation, *(_ITEM.validate_python(i) for i in output))
        num_chars = len(dumps(response)) + sum(len(i.model_dump_json()) for i in conversation)
        self.store.put(response["id"], KeptResponse(self.owner, response, conversation,
                                                    num_chars))


class _Output:
    """A response's output items as they are written, and the SSE events that write them
    (a whole answer is written the same way, its events unsent)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the last item, until it is done
        self._num_events = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def reasoning(self, delta: str) -> list[str]:
        out = self._part_item("reasoning")
        return out + self._text_delta("response.reasoning_text.delta", delta)

    def text(self, delta: str) -> list[str]:
        out = self._part_item("message")
        return out + self._text_delta("response.output_text.delta", delta, logprobs=[])

    def call(self, call_id: str, name: str) -> list[str]:
        return self._begin({"id": _new_id("fc"), "type": "function_call",
                            "status": "in_progress", "call_id": call_id, "name": name,
                            "arguments": ""})

    def arguments(self, delta: str) -> list[str]:
        item = self._open
        assert item is not None and item["type"] == "function_call"
        item["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.items) - 1, delta=delta)]

    def chat_delta(self, delta: dict[str, Any]) -> list[str]:
        """The items' events for one of the chat path's deltas ({"content": text} or
        {"tool_calls": [...]}, a call's first delta carrying its id and name)."""
        out = self.text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out += self.call(call["id"], function.get("name", ""))
            if function.get("arguments"):
                out += self.arguments(function["arguments"])
        return out

    def finish(self, meta: dict[str, Any], num_reasoning_tokens: int) -> list[str]:
        """Close the items (an empty message when there were none) and complete the
        response: incomplete when max_output_tokens ended it."""
        is_cut = (meta.get("finish_reason") or {}).get("type") == "length"
        status = "incomplete" if is_cut else "completed"
        out = [] if self.items else self._part_item("message")
        out += self._close(status)
        num_in, num_out = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
        self.response.update(
            status=status, output=self.items,
            incomplete_details={"reason": "max_output_tokens"} if is_cut else None,
            usage={"input_tokens": num_in,
                   "input_tokens_details": {"cached_tokens": int(meta.get("cached_tokens", 0))},
                   "output_tokens": num_out,
                   "output_tokens_details": {"reasoning_tokens": min(num_reasoning_tokens,
                                                                     num_out)},
                   "total_tokens": num_in + num_out})
        kind = "response.incomplete" if is_cut else "response.completed"
        return out + [self.event(kind, response=self.response)]

    def failed(self, status_code: int, message: str) -> str:
        """The events of a failure after the stream began (sse_response's error_event)."""
        code = "server_error" if status_code >= 500 else "invalid_prompt"
        self.response.update(status="failed", output=self.items,
                             error={"code": code, "message": message})
        return (self.event("error", code=code, message=message, param=None)
                + self.event("response.failed", response=self.response))

    def _begin(self, item: dict[str, Any]) -> list[str]:
        out = self._close("completed")
        self.items.append(item)
        self._open = item
        return out + [self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item)]

    def _part_item(self, kind: Literal["message", "reasoning"]) -> list[str]:
        """Open a message (or reasoning) item with its one text part, unless it is open."""
        if self._open is not None and self._open["type"] == kind:
            return []
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        out = self._begin(item)
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0, part=part))
        item["content"].append(part)
        return out

    def _text_delta(self, kind: str, delta: str, **extra: Any) -> list[str]:
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        return [self.event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=delta, **extra)]

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where,
                              name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out = [self.event("response.output_text.done", **where, content_index=0,
                                  text=part["text"], logprobs=[])]
            else:
                out = [self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=part["text"])]
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
        item["status"] = status
        return out + [self.event("response.output_item.done", output_index=where[
            "output_index"], item=item)]


async def _events(job: _Job, out: _Output, stream: EngineStream) -> AsyncIterator[str]:
    for event in out.start():
        yield event
    splitter = job.thinking.reader() if job.thinking is not None else None
    reader = job.plan.stream() if job.plan is not None else None
    meta: dict[str, Any] = {}
    async for chunk in stream:
        meta = chunk.get("meta_info") or meta
        text = chunk.get("text", "")
        finished = fmt.finish_reason(meta) is not None
        parts = [("content", text)] if splitter is None else (
            splitter.feed(text) + (splitter.finish() if finished else []))
        events = [e for kind, piece in parts if kind == "reasoning"
                  for e in out.reasoning(piece)]
        content = "".join(piece for kind, piece in parts if kind == "content")
        if reader is None:
            deltas = [{"content": content}] if content else []
        else:
            deltas = reader.feed(content) + (reader.finish() if finished else [])
        events += [e for delta in deltas for e in out.chat_delta(delta)]
        for event in events:
            yield event
        if finished:
            break
    raise_if_aborted(meta)
    events = out.finish(meta, job.num_reasoning_tokens(out))
    job.keep(out.response, out.items)
    for event in events:
        yield event
