"""What every route needs to reach: the engine, the runner, metrics, and resolved server facts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from sglang_like.config import ServerArgs
from sglang_like.server.errors import ApiError
from sglang_like.server.metrics import ServerMetrics
from sglang_like.server.model_name import model_name_from_path
from sglang_like.server.runner import EngineRunner


@dataclass(frozen=True)
class ServerState:
    """Built once by `create_app`; routes read it from `request.app.state.server`."""

    engine: Any
    runner: EngineRunner
    metrics: ServerMetrics
    server_args: ServerArgs
    model_path: str
    served_model_name: str
    context_length: int
    # the LoRA adapters' names as this server last heard them from the engine (at start, then
    # after each load and unload, under lora_lock): an OpenAI `model` is resolved against them
    # without asking the engine, whose answer waits for a scheduler step (server/lora_api.py)
    lora_names: set[str] = field(default_factory=set)
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one update at a time

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_prompt_chars(self) -> int:
        return self.server_args.max_prompt_chars or 32 * self.context_length

    def check_text_length(self, texts: Any, param: str = "prompt") -> None:
        """400 for text no prompt of the context length could be, before any of it is
        tokenized (or put through a chat template): tokenizing megabytes costs everyone."""
        items = [texts] if isinstance(texts, str) else list(texts or [])
        total = sum(len(t) for t in items if isinstance(t, str))
        if total > self.max_prompt_chars:
            raise ApiError(400, f"the prompt text is {total} characters; at most "
                                f"{self.max_prompt_chars} are taken (--max-prompt-chars)", param)

    @classmethod
    def build(cls, engine: Any, server_args: ServerArgs | None = None) -> ServerState:
        args = server_args or getattr(engine, "server_args", None) or ServerArgs()
        model_config = getattr(engine, "model_config", None)
        model_path = (
            getattr(model_config, "model_path", "") or args.model_path or "default"
        )
        name = args.served_model_name or model_name_from_path(model_path)
        context_length = args.context_length or getattr(
            model_config, "max_position_embeddings", 2048
        )
        metrics = ServerMetrics()
        runner = EngineRunner(
            engine, metrics, args.max_queued_requests, args.max_running_requests,
            args.enable_cross_tenant_cache,
        )
        lister = getattr(engine, "list_lora_adapters", None)
        lora_names = ({a["name"] for a in lister()}
                      if lister is not None and (args.enable_lora or args.lora_paths) else set())
        return cls(engine, runner, metrics, args, model_path, name, int(context_length),
                   lora_names)


def get_state(request: Request) -> ServerState:
    return request.app.state.server
