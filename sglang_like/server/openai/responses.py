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

This module holds the request bodies, their translation to the chat request, the job and the
routes; the output items and their events are written by response_events.py, and the kept
responses live in response_store.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
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
from sglang_like.server.auth import principal_of
from sglang_like.server.chat_layer import (
    ChatPrompt,
    chat_prompt,
    parse_body,
    raise_if_aborted,
    refuse_images,
)
from sglang_like.server.errors import ApiError, dumps, json_response, read_json_body
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.chat import tool_plan
from sglang_like.server.openai.reasoning import (
    BudgetStream,
    ReasoningPlan,
    generate_with_budget,
)
from sglang_like.server.openai.response_events import _Output, new_id
from sglang_like.server.openai.response_store import (
    KeptResponse,
    ResponseStore,
    find_kept,
    response_store,
)
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import ChatCompletionRequest, check_max_tokens, parse_model
from sglang_like.server.runner import EngineStream
from sglang_like.server.sse import open_streams, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")

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
        kept = find_kept(request, body.previous_response_id, "previous_response_id").conversation
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
    return json_response(find_kept(request, response_id).response)


@router.delete("/responses/{response_id}", openapi_extra=operation(ok=json_content({
    "type": "object", "required": ["id", "object", "deleted"],
    "properties": {"id": _STR, "object": {"const": "response"}, "deleted": {"const": True}}}),
    errors=(400, 401, 404)))
async def delete_response(request: Request, response_id: str) -> Response:
    """Forget a kept response (later previous_response_id naming it is a 404)."""
    _check_no_query(request)
    find_kept(request, response_id)
    response_store(request).delete(principal_of(request.scope).tenant, response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _check_no_query(request: Request) -> None:
    """GET's stream / include / starting_after would replay or extend an answer: not served."""
    names = list(request.query_params)
    if names:
        raise ApiError(400, f"query parameter {names[0]!r} is not supported", names[0])


# ---- answers -----------------------------------------------------------------------------------
def _head(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object before any output (echoing the request as OpenAI does)."""
    form = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "id": new_id("resp"), "object": "response", "created_at": fmt.now(),
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
