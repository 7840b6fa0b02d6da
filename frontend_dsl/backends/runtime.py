"""Runtime: the engine in this process, no HTTP; sglang_like is imported only when one is built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_dsl.backends.base import NativeBackend
from frontend_dsl.chat_template import template_from_jinja


class Runtime(NativeBackend):
    """Runs programs on `sglang_like.Engine(model_path, **server_args)` in this process.

    Pass `engine=` to share an already built Engine (it is then not shut down by this backend).
    """

    def __init__(self, model_path: str | None = None, *, engine: Any = None,
                 **server_args: Any) -> None:
        self._owns_engine = engine is None
        if engine is None:
            from sglang_like.engine import Engine  # lazy: client installs have no torch

            engine = Engine(model_path=model_path, **server_args)
        self.engine = engine
        tokenizer = engine.tokenizer
        self.chat_template = template_from_jinja(getattr(tokenizer, "chat_template", None))

    def _call(self, body: dict[str, Any], stream: bool) -> Any:
        return self.engine.generate(
            prompt=body.get("text"),
            sampling_params=body.get("sampling_params"),
            input_ids=body.get("input_ids"),
            return_logprob=body.get("return_logprob", False),
            logprob_start_len=body.get("logprob_start_len", -1),
            top_logprobs_num=body.get("top_logprobs_num", 0),
            return_text_in_logprobs=body.get("return_text_in_logprobs", False),
            stream=stream,
            **({"image_data": body["image_data"]} if "image_data" in body else {}),
        )

    def _request(self, body: dict[str, Any]) -> Any:
        return self._call(body, stream=False)

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._call(body, stream=True)  # the engine's chunks are already incremental

    def get_model_name(self) -> str:
        """The engine's model path (the default model's file when none was given)."""
        return str(getattr(self.engine.model_config, "model_path", "") or "")

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
