"""EngineCore: what runs beside the scheduler loop, in the engine-core process or a thread."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from sglang_like.config import ModelConfig, ServerArgs
from sglang_like.engine_core.messages import GenerateReqInput
from sglang_like.engine_loop import EngineLoop, LoopHooks
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams


@dataclass(frozen=True)
class CoreInfo:
    """What the Engine learns from its core once the model is loaded."""

    server_args: ServerArgs  # every "auto" resolved
    model_config: ModelConfig
    device: str
    dtype: str
    eos_token_ids: frozenset[int]
    weight_bytes: int


def make_req(msg: GenerateReqInput) -> Req:
    """The scheduler's request for a message (its fields were validated by the Engine)."""
    req = Req(msg.rid, list(msg.input_ids), SamplingParams(**msg.sampling_params),
              return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
              top_logprobs_num=msg.top_logprobs_num, stream=msg.stream)
    if msg.arrival_time:
        req.arrival_time = msg.arrival_time
    return req


class EngineCore:
    """The model, its scheduler and the loop that drives them; built on the loop's thread."""

    RPC_METHODS = ("get_server_info", "get_load", "flush_cache")

    def __init__(self, server_args: ServerArgs, hooks: LoopHooks | None = None) -> None:
        from sglang_like.engine_setup import build_engine_parts

        parts = build_engine_parts(server_args)
        self.server_args, self.model_config = parts.server_args, parts.model_config
        self.tokenizer, self.runner, self.scheduler = parts.tokenizer, parts.runner, parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self.info = CoreInfo(
            self.server_args, self.model_config, str(parts.device),
            str(parts.dtype).removeprefix("torch."), self.eos_token_ids,
            int(self.runner.model.weight_bytes()),
        )
        self._grammar_backend: Any = None
        self._grammar_lock = threading.Lock()
        self.loop = EngineLoop(self.tokenizer, self.server_args.watchdog_timeout,
                               grammar_backend=lambda: self.grammar_backend, hooks=hooks)
        self.loop.scheduler = self.scheduler

    @property
    def grammar_backend(self) -> Any:
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = build_grammar_backend(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                    self.server_args.grammar_backend)
            return self._grammar_backend

    def shutdown_grammars(self) -> None:
        with self._grammar_lock:
            if self._grammar_backend is not None:
                self._grammar_backend.shutdown()

    # ---- RPC_METHODS: called on the loop thread ---------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            **{k: v for k, v in vars(self.server_args).items() if k != "api_key"},
            "model_path": self.model_config.model_path,
            "engine_pid": os.getpid(),  # the engine-core process (this one's pid in-process)
            "kv_pool": {**s.kv_pool_info(),
                        "bytes_per_slot": self.runner.kv_pool.bytes_per_slot},
            "cache_hit_rate": s.cache_hit_rate,
            "num_running_reqs": len(s.running),
            "num_queued_reqs": len(s.waiting) + self.loop.num_pending_commands,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            # speculative decoding: how many verify passes committed k tokens
            "spec_accept_lengths": dict(sorted(s.spec_accept_lengths.items())),
            # faults injected so far (SGLANG_LIKE_FAULT_INJECT), by site; {} when off
            "injected_faults": s.faults.stats() if s.faults.enabled else {},
            "context_length": self.server_args.context_length,
        }

    def get_load(self) -> dict[str, int]:
        """What SGLang's /get_load reports for one data-parallel rank: requests (running and
        waiting), waiting requests, and the KV slots the running requests hold."""
        s = self.scheduler
        waiting = len(s.waiting) + self.loop.num_pending_commands
        return {"dp_rank": 0, "num_reqs": len(s.running) + waiting,
                "num_waiting_reqs": waiting, "num_tokens": s.kv_pool_info()["used_slots"]}

    def flush_cache(self) -> bool:
        """Empty the radix cache; False while requests are queued or running."""
        return self.scheduler.flush_cache()


def build_grammar_backend(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                          name: str) -> Any:
    from constrained import GrammarBackend, TokenizerInfo

    info = TokenizerInfo(vocab=tokenizer.token_bytes_list(), vocab_size=vocab_size,
                         eos_token_ids=eos_token_ids,
                         special_token_ids=tokenizer.special_token_ids)
    return GrammarBackend(info, name)
