"""Backend contract, and NativeBackend: everything shared by the two `/generate`-shaped backends."""

from __future__ import annotations

import base64
import io
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from frontend_dsl.chat_template import ChatTemplate
from frontend_dsl.choices import choice_token_logprobs, decide
from frontend_dsl.ir import GenParams


class TokenUsage:
    """Prompt and completion tokens of the gen calls a backend has served (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        with self._lock:
            self.prompt_tokens += int(meta_info.get("prompt_tokens") or 0)
            self.completion_tokens += int(meta_info.get("completion_tokens") or 0)

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0

    def __repr__(self) -> str:
        return f"TokenUsage(prompt_tokens={self.prompt_tokens}, " \
               f"completion_tokens={self.completion_tokens})"


class Backend(ABC):
    """What the interpreter needs from a model. Implementations must be thread-safe:
    fork branches and run_batch items call them concurrently."""

    chat_template: ChatTemplate
    is_chat_model = False  # True: only a chat API (prompts must be whole messages)

    @property
    def token_usage(self) -> TokenUsage:
        """Token counts of the gen calls served so far (SGLang's `backend.token_usage`)."""
        return self.__dict__.setdefault("_token_usage", TokenUsage())

    @property
    def endpoint(self) -> Backend:
        """SGLang compatibility: `sgl.Runtime(...).endpoint` is the backend programs run on;
        every backend here is its own endpoint."""
        return self

    @abstractmethod
    def generate(self, prompt: str, params: GenParams) -> tuple[str, dict[str, Any]]:
        """Continue `prompt`; returns (completion text, meta_info)."""

    @abstractmethod
    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, dict]]:
        """Yield (new text, meta_info) pieces of the completion."""

    @abstractmethod
    def select(self, prompt: str, choices: list[str], temperature: float,
               method: str) -> tuple[str, dict[str, Any]]:
        """Pick one of `choices` as the continuation of `prompt`; returns (choice, meta_info)."""

    def cache_prefix(self, prefix: str) -> None:  # noqa: B027 - optional, no-op by default
        """Ask the runtime to hold `prefix` in its prefix cache (no-op where unsupported)."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional, no-op by default
        """Release what the backend holds."""


class NativeBackend(Backend):
    """Speaks SGLang-native `/generate` bodies; subclasses only move a body to the runtime.

    `_request(body)` returns one result dict (or a list for a batched body);
    `_request_stream(body)` yields chunks whose `text` is the NEW text only.
    """

    @abstractmethod
    def _request(self, body: dict[str, Any]) -> Any: ...

    @abstractmethod
    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]: ...

    takes_images = True  # sgl.image: image_data goes with the prompt
    image_placeholder = "<image>"  # what a vision-language model's prompt names an image by

    def _gen_body(self, prompt: str, params: GenParams, images: list[Any] | None = None
                  ) -> dict[str, Any]:
        return {"text": prompt, "sampling_params": params.to_sampling_params(),
                **params.logprob_options(), **_image_data(images)}

    def generate(self, prompt: str, params: GenParams, images: list[Any] | None = None
                 ) -> tuple[str, dict[str, Any]]:
        out = self._request(self._gen_body(prompt, params, images))
        if isinstance(out, list):  # n > 1
            for o in out:
                self.token_usage.add(o["meta_info"])
            return out[0]["text"], {"choices": [o["text"] for o in out], **out[0]["meta_info"]}
        self.token_usage.add(out["meta_info"])
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt: str, params: GenParams, images: list[Any] | None = None
                        ) -> Iterator[tuple[str, dict]]:
        meta: dict[str, Any] = {}
        body = {**self._gen_body(prompt, params, images), "stream": True}
        for chunk in self._request_stream(body):
            meta = chunk["meta_info"]
            yield chunk["text"], meta
        self.token_usage.add(meta)  # the last chunk's counts are the totals

    def cache_prefix(self, prefix: str, images: list[Any] | None = None) -> None:
        self._request({"text": prefix, "sampling_params": {"max_new_tokens": 0},
                       **_image_data(images)})

    def select(self, prompt: str, choices: list[str], temperature: float,
               method: str, images: list[Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Prefill the prompt once (cached), then score every choice in one batched request
        (the prompt's images, if any, with each)."""
        start = prefix_len = 0
        image_data = _image_data(images)
        if prompt:
            warm = self._request({"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                  **image_data})
            # two tokens back: the prompt's last token may merge with the choice's first
            prefix_len = warm["meta_info"]["prompt_tokens"]
            start = max(prefix_len - 2, 0)
        outs = self._request({
            "text": [prompt + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
            **({"image_data": [image_data["image_data"]] * len(choices)} if image_data else {}),
        })
        per_choice = [
            choice_token_logprobs(o["meta_info"]["input_token_logprobs"], c,
                                  o["meta_info"]["prompt_tokens"] - prefix_len)
            for o, c in zip(outs, choices, strict=False)
        ]
        uncond = None
        if method == "unconditional_likelihood_normalized":
            ids = [[e[1] for e in lp] for lp in per_choice]
            res = self._request({"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": 0})
            uncond = [r["meta_info"]["input_token_logprobs"] for r in res]
        return decide(method, choices, per_choice, uncond)


def _image_data(images: list[Any] | None) -> dict[str, Any]:
    """`image_data` for a /generate body: local files read here and sent as base64 (a server
    reads its own disk only under --allowed-local-media-path), bytes and PIL images encoded,
    URLs and base64 passed through."""
    if not images:
        return {}
    return {"image_data": [_image_payload(i) for i in images]}


def _image_payload(source: Any) -> str:
    if hasattr(source, "save"):  # a PIL image
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        source = buf.getvalue()
    if isinstance(source, (bytes, bytearray)):
        return base64.b64encode(bytes(source)).decode()
    if not isinstance(source, str):
        raise ValueError(f"sgl.image takes a path, URL, base64 text, bytes or a PIL image, "
                         f"not {type(source).__name__}")
    if source.startswith(("data:", "http://", "https://")):
        return source
    path = os.path.expanduser(source[7:] if source.startswith("file://") else source)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()
    return source  # base64 already, or a path the runtime may read
