"""What the APIs layered over the chat path of /v1/chat/completions (Anthropic's Messages,
Ollama's, OpenAI's Responses) share: a body read with each unserved field named, refusals
answered in the API's own error shape, an aborted answer raised as an error, and the prompt
step (the chat template rendered off the event loop into a ChatPrompt, images refused for a
text-only model, a prompt's length counting each image as its tokens).

Apart from anthropic_api.py, where they were first written, so that the Ollama and Responses
routes need not import Anthropic's API to reach them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.function_call import ToolPlan
from sglang_like.server.errors import ApiError, pydantic_message
from sglang_like.server.openai.chat import render_chat_prompt
from sglang_like.server.openai.common import check_prompt_len
from sglang_like.server.protocol import ChatCompletionRequest
from sglang_like.server.runner import ClientGone
from sglang_like.server.state import ServerState, get_state

_M = TypeVar("_M", bound=BaseModel)


# ---- bodies and answers ------------------------------------------------------------------------
def parse_body(model: type[_M], data: Any) -> _M:
    """Validate a decoded JSON body into `model` (extra="forbid"); ApiError(400) naming each
    bad field, and each field the server would not act on as such."""
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        unserved = [".".join(str(x) for x in err["loc"]) for err in errors
                    if err["type"] == "extra_forbidden"]
        if not unserved:
            raise ApiError(400, pydantic_message(e)) from None
        others = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errors
                  if err["type"] != "extra_forbidden"]
        message = "; ".join([f"not supported by this server: {', '.join(unserved)}", *others])
        raise ApiError(400, message, unserved[0]) from None


async def answer_refusals(route: Any, request: Request,
                          respond: Callable[[int, str], Response]) -> Response:
    """`route(request)`, its refusals answered by `respond(status, message)` in its API's
    shape (Anthropic's, Ollama's): an ApiError as it says, the engine's ValueError as a 400;
    a client that left gets 499."""
    try:
        return await route(request)
    except ClientGone:
        return Response(status_code=499)
    except ApiError as e:
        return respond(e.status_code, e.message)
    except ValueError as e:  # the engine's refusal of the request
        get_state(request).metrics.observe_rejected(400)
        return respond(400, str(e) or type(e).__name__)


def raise_if_aborted(meta: dict[str, Any]) -> None:
    """An answer the engine aborted is an error (neither Anthropic's nor Ollama's stop reasons
    can say it): its own status where it has one (400: a grammar that does not compile, an
    adapter not loaded), else 500 (an internal error, a shutdown, an operator's abort)."""
    reason = meta.get("finish_reason") or {}
    if reason.get("type") not in (None, "stop", "length"):
        raise ApiError(int(reason.get("status_code") or 500),
                       reason.get("message") or "the request was aborted")


# ---- the prompt --------------------------------------------------------------------------------
class ChatPrompt(NamedTuple):
    """A chat request's prompt as the engine takes it."""

    text: str  # the rendered chat template
    input_ids: list[int]  # its tokens: an image is still its one placeholder here
    images: list[str]  # the image_url parts' URLs, in the order of their placeholders

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """Token ids, or with images the text and the images: the engine expands each
        placeholder into its image's tokens, which only it (its prompter) knows."""
        if self.images:
            return {"prompt": self.text, "image_data": self.images}
        return {"input_ids": self.input_ids}


def refuse_images(state: ServerState, has_images: bool, what: str, where: str) -> None:
    """400 for images sent to a text-only model (before any of them is fetched)."""
    if has_images and getattr(state.engine, "image_prompter", None) is None:
        raise ApiError(400, f"the model {state.served_model_name!r} reads text only; {what} "
                            "need a vision-language model", where)


async def chat_prompt(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan | None,
                      what: str) -> ChatPrompt:
    """The chat template applied to `req` and tokenized on a worker thread (off the loop that
    streams), its length checked; images (`what` in the text-only model's 400) kept apart."""
    images = [url for m in req.messages for url in m.image_urls()]
    refuse_images(state, bool(images), what, "messages")
    text, input_ids = await run_in_threadpool(render_chat_prompt, state, req, plan)
    check_prompt_len(state, len(input_ids))
    return ChatPrompt(text, input_ids, images)


async def num_prompt_tokens(state: ServerState, prompt: ChatPrompt) -> int:
    """The prompt's length as the engine will count it: each image placeholder expanded into
    the image's tokens (the images loaded and preprocessed on a worker thread to learn it)."""
    if not prompt.images:
        return len(prompt.input_ids)
    return await run_in_threadpool(_expanded_len, state, prompt)


def _expanded_len(state: ServerState, prompt: ChatPrompt) -> int:
    from sglang_like.engine_core.io import encode_prompt
    from sglang_like.multimodal.images import ImageLimits, load_image

    args = state.server_args
    cap = args.limit_mm_per_prompt
    if len(prompt.images) > cap:  # as the engine would refuse it
        raise ApiError(400, f"a prompt takes at most {cap} images; it has {len(prompt.images)}",
                       "messages")
    limits = ImageLimits(allowed_local_path=args.allowed_local_media_path)
    try:
        pictures = [load_image(url, limits) for url in prompt.images]
        ids, _ = state.engine.image_prompter.build(
            prompt.text, pictures, functools.partial(encode_prompt, state.tokenizer))
    except ValueError as e:  # an unreadable or refused image, a stray placeholder
        raise ApiError(400, str(e), "messages") from None
    return len(ids)
