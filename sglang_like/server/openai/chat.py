"""POST /v1/chat/completions: OpenAI's chat completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.function_call import ToolPlan
from sglang_like.server.auth import principal_of
from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.lora_api import resolve_model
from sglang_like.server.native_api import choice_params
from sglang_like.server.openai import format as fmt
from sglang_like.server.openai.common import (
    check_prompt_len,
    logprob_kwargs,
    ok_content,
    stream_usage,
)
from sglang_like.server.openai.reasoning import (
    BudgetStream,
    ReasoningPlan,
    check_template_kwargs,
    generate_with_budget,
)
from sglang_like.server.openapi import operation
from sglang_like.server.protocol import ChatCompletionRequest, bootstrap_kwargs, parse_model
from sglang_like.server.runner import ClientGone, EngineStream, merge_streams
from sglang_like.server.sse import DONE, open_streams, sse, sse_response
from sglang_like.server.state import ServerState, get_state

router = APIRouter(prefix="/v1")


@router.post("/chat/completions", openapi_extra=operation(
    body=ChatCompletionRequest, ok=ok_content("ChatCompletionResponse"),
    errors=(400, 401, 404, 429, 500),
))
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    req = parse_model(ChatCompletionRequest, await read_json_body(request))
    req.check(state.context_length)
    lora, model = resolve_model(state, req.model, req.lora_path)
    plan = tool_plan(state, req)
    state.check_text_length([_content_text(m.content) for m in req.messages], "messages")
    if any(m.image_urls() for m in req.messages) and state.engine.image_prompter is None:
        raise ApiError(400, f"the model {model!r} reads text only; image_url content parts "
                            "need a vision-language model", "messages")
    # the template and the tokenizer run on a worker thread, off the loop that streams
    prompt, input_ids = await run_in_threadpool(render_chat_prompt, state, req, plan)
    check_prompt_len(state, len(input_ids))
    args = state.server_args
    thinking = ReasoningPlan.build(args.reasoning_parser, args.reasoning_budget, req, prompt)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = max(1, state.context_length - len(input_ids))
    sampling = req.sampling_dict(max_tokens)
    if plan is not None:
        try:
            sampling = plan.sampling_params(sampling)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
    if thinking is not None:  # a schema or tool format goes after the think block
        thinking, sampling = thinking.constrain(sampling, args.grammar_backend)
    budget = thinking if thinking is not None and thinking.has_budget else None
    images = [url for m in req.messages for url in m.image_urls()]
    # with images the engine expands each placeholder into the image's tokens from the text
    prompt_kwargs: dict[str, Any] = {"prompt": prompt, "image_data": images} if images else {
        "input_ids": input_ids}
    if images and budget is not None:
        raise ApiError(400, "a thinking budget does not take images yet", "messages")
    base = {**prompt_kwargs, **logprob_kwargs(req.logprobs, req.top_logprobs or 0),
            **bootstrap_kwargs(req), **lora}
    if req.stream:
        first = sampling if budget is None else {
            **sampling, "max_new_tokens": budget.first_max_tokens(max_tokens)}
        calls = [{**base, "sampling_params": choice_params(first, j)} for j in range(req.n)]
        streams: list[Any] = await open_streams(state.runner, calls, request)
        if budget is not None:
            owner = principal_of(request.scope).tenant
            streams = [BudgetStream(state.runner, s, call, owner, budget, state.tokenizer,
                                    max_tokens) for s, call in zip(streams, calls, strict=True)]
        return sse_response(_chat_events(model, req, plan, thinking, streams), streams)
    try:
        if budget is not None:
            items = await generate_with_budget(state.runner, request, base, sampling, req.n,
                                               budget, state.tokenizer)
        else:
            (result,) = await state.runner.generate(
                request, [{**base, "sampling_params": {**sampling, "n": req.n}}]
            )
            items = result if isinstance(result, list) else [result]
    except ClientGone:
        return Response(status_code=499)
    if (message := fmt.internal_error([items])) is not None:
        raise ApiError(500, message)
    choices = [fmt.chat_choice(j, item, req.logprobs) for j, item in enumerate(items)]
    for choice in choices:
        if thinking is not None and thinking.separate:
            _read_reasoning(thinking, choice)
        if plan is not None:
            _read_tool_calls(plan, choice)
    return json_response(
        {
            "id": fmt.new_id("chatcmpl"),
            "object": "chat.completion",
            "created": fmt.now(),
            "model": model,
            "choices": choices,
            "usage": fmt.usage(items),
        }
    )


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p.get("text"), str))
    return content or ""


def tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan | None:
    args = state.server_args
    try:
        return ToolPlan.build(
            req.tools, req.tool_choice, req.parallel_tool_calls, args.tool_call_parser,
            getattr(state.tokenizer, "chat_template", None), args.grammar_backend,
        )
    except ValueError as e:
        raise ApiError(400, str(e), "tools") from None


def _read_reasoning(thinking: ReasoningPlan, choice: dict[str, Any]) -> None:
    """Split a choice's text into reasoning_content and content (None when empty)."""
    message = choice["message"]
    reasoning, content = thinking.split(message["content"] or "")
    message["reasoning_content"] = reasoning
    message["content"] = content or None


def _read_tool_calls(plan: ToolPlan, choice: dict[str, Any]) -> None:
    """Turn a choice's text into content + tool_calls; finish_reason "tool_calls" when the
    model ended its turn with calls."""
    message = choice["message"]
    content, calls = plan.read(message["content"] or "")
    message["content"] = content
    message["tool_calls"] = [c.to_openai() for c in calls] or None
    if calls and choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"


async def _chat_events(
    model: str, req: ChatCompletionRequest, plan: ToolPlan | None,
    thinking: ReasoningPlan | None, streams: list[EngineStream],
) -> AsyncIterator[str]:
    head = {"id": fmt.new_id("chatcmpl"), "object": "chat.completion.chunk",
            "created": fmt.now(), "model": model}
    readers = [plan.stream() for _ in streams] if plan is not None else None
    splitters = [thinking.reader() for _ in streams] if (
        thinking is not None and thinking.separate) else None
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
        parts = [("content", text)] if text else []
        if splitters is not None:
            parts = splitters[index].feed(text)
            if reason is not None:
                parts += splitters[index].finish()
        deltas = [{"reasoning_content": t} for kind, t in parts if kind == "reasoning"]
        content = "".join(t for kind, t in parts if kind == "content")
        if readers is None:
            deltas += [{"content": content}] if content else []
        else:
            deltas += readers[index].feed(content)
            if reason is not None:
                deltas += readers[index].finish()
                if readers[index].num_calls and reason == "stop":
                    reason = "tool_calls"
        # the logprobs ride on the first delta of this chunk (or on the finishing one)
        for delta in deltas[:-1] if reason is not None else deltas:
            yield sse({**head, "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            ]})
            logprobs = None
        if reason is None:
            continue
        delta = deltas[-1] if deltas else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                  "matched_stop": fmt.matched_stop(meta)}
        yield sse({**head, "choices": [choice]})
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": stream_usage(last_meta, req.n)})
    yield DONE


def chat_input_ids(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan | None
) -> list[int]:
    return render_chat_prompt(state, req, plan)[1]


def render_chat_prompt(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan | None
) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    template_kwargs = check_template_kwargs(getattr(req, "chat_template_kwargs", None),
                                            tokenizer.chat_template)
    messages = [m.template_dict() for m in req.messages]
    if getattr(state.engine, "image_prompter", None) is not None:
        # vision-language templates (SmolVLM's, llava-hf's) read every message's content as a
        # list of parts, as their Hugging Face processors pass it
        for m in messages:
            if isinstance(m.get("content"), str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    prompt = None
    # a template with no tool syntax may still refuse a `tool` turn: then results go in user turns
    for tool_role in (True, False) if plan is not None else (False,):
        turns, tools = plan.template_inputs(messages, tool_role) if plan else (messages, None)
        try:
            prompt = tokenizer.apply_chat_template(
                turns, add_generation_prompt=not req.continue_final_message, tools=tools,
                **template_kwargs,
            )
            break
        except Exception as e:  # noqa: BLE001 - a template's own error is about this request
            error = e
    if prompt is None:
        raise ApiError(400, f"chat template failed on these messages: {error}") from None
    if req.continue_final_message:
        last = messages[-1]["content"]
        if isinstance(last, list):  # with images: its text parts
            last = "".join(p.get("text", "") for p in last)
        prompt = _strip_end_of_turn(prompt, last)
    return prompt, list(tokenizer.encode(prompt))


def _strip_end_of_turn(prompt: str, last_content: str) -> str:
    """Cut the template's end-of-turn text after the final message, so the model continues it."""
    cut = prompt.rfind(last_content)
    return prompt[: cut + len(last_content)] if cut >= 0 and last_content else prompt
