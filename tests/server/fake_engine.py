"""A tiny in-memory stand-in for `Engine`, only for unit tests of the HTTP layer.

It follows the engine contract (result shapes, streaming deltas, ValueError for bad input,
abort on close, KV pool accounting) with one character per token and no model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from sglang_like.config import ServerArgs
from sglang_like.sampling_params import SamplingParams


class FakeTokenizer:
    chat_template = "{% for m in messages %}<{{m.role}}>{{m.content}}{% endfor %}<assistant>"
    eos_token_ids = (0,)
    vocab_size = 0x110000  # every code point is a token

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Any = None) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Generates 'a', 'b', 'c', ... one token per `step_s`; max_running_requests at a time."""

    def __init__(self, step_s: float = 0.005, context_length: int = 256,
                 total_slots: int = 4096, **server_args: Any) -> None:
        self.server_args = ServerArgs(context_length=context_length, **server_args)
        self.model_config = SimpleNamespace(model_path="/models/fake-model.Q4_1.gguf",
                                            hidden_size=64,
                                            max_position_embeddings=context_length)
        self.tokenizer = FakeTokenizer()
        self.step_s = step_s
        self.total_slots = total_slots
        self.used_slots = 0
        self.cached_slots = 0
        self.seen_prompts: set[tuple[str | None, ...]] = set()
        self.aborted: set[str] = set()
        self.num_abort_all = 0
        self.health_reason: str | None = None  # what check_health() answers; None: healthy
        self.calls: list[dict[str, Any]] = []
        self._running = asyncio.Semaphore(self.server_args.max_running_requests)
        self._num_waiting = 0
        self._num_running = 0
        self._num_prompt = 0
        self._num_cached = 0

    # ---- the contract -------------------------------------------------------------------
    @property
    def num_queued_requests(self) -> int:
        return self._num_waiting

    def get_server_info(self) -> dict[str, Any]:
        free = self.total_slots - self.used_slots - self.cached_slots
        return {
            "kv_pool": {"total_slots": self.total_slots, "free_slots": free,
                        "cached_slots": self.cached_slots, "used_slots": self.used_slots},
            "cache_hit_rate": self._num_cached / self._num_prompt if self._num_prompt else 0.0,
            "num_running_reqs": self._num_running, "num_queued_reqs": self._num_waiting,
            "max_total_tokens": self.total_slots,
            "context_length": self.server_args.context_length,
        }

    def get_load(self) -> dict[str, int]:
        return {"dp_rank": 0, "num_reqs": self._num_running + self._num_waiting,
                "num_waiting_reqs": self._num_waiting, "num_tokens": self.used_slots}

    def flush_cache(self) -> bool:
        if self.used_slots:
            return False
        self.cached_slots = 0
        self.seen_prompts.clear()
        return True

    def abort(self, rid: str) -> None:
        self.aborted.add(rid)

    def abort_all(self) -> None:
        self.num_abort_all += 1

    def check_health(self) -> str | None:
        return self.health_reason

    image_prompter = None  # a text-only model (Engine.image_prompter)

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False,
                             rid: Any = None, bootstrap_host: Any = None,
                             bootstrap_port: Any = None, bootstrap_room: Any = None,
                             cache_salt: str | None = None, lora_path: Any = None,
                             image_data: Any = None, pooling: str | None = None,
                             priority: int | None = None) -> Any:
        if lora_path is not None and any(n is not None for n in (
                lora_path if isinstance(lora_path, list) else [lora_path])):
            raise ValueError("LoRA is not enabled (the fake engine serves no adapters)")
        if priority:  # as an Engine without --enable-priority-scheduling answers
            raise ValueError("priority scheduling is off (--enable-priority-scheduling)")
        if pooling is not None:
            raise ValueError("the fake engine computes no embeddings")
        if image_data is not None:  # as a text-only model's Engine answers
            raise ValueError("the model 'fake' reads text only; it takes no image input "
                             "(image_data)")
        self.calls.append({"prompt": prompt, "input_ids": input_ids, "stream": stream,
                           "sampling_params": sampling_params, "rid": rid,
                           "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                           "logprob_start_len": logprob_start_len,
                           "bootstrap": (bootstrap_host, bootstrap_port, bootstrap_room),
                           "cache_salt": cache_salt})
        is_batch = isinstance(prompt, list) or (bool(input_ids) and isinstance(input_ids[0], list))
        texts = prompt if isinstance(prompt, list) else [prompt]
        ids_list = input_ids if is_batch and input_ids is not None else [input_ids]
        if prompt is not None:
            ids_list = [self.tokenizer.encode(t) for t in texts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(
            ids_list)
        params = [SamplingParams.from_dict(sp) for sp in sps]
        for ids in ids_list:
            if not ids:
                raise ValueError("empty prompt")
            if len(ids) >= self.server_args.context_length:
                raise ValueError(f"prompt of {len(ids)} tokens is longer than the context")
            if any(not 0 <= t < FakeTokenizer.vocab_size for t in ids):
                raise ValueError(f"input_ids must be integers in [0, {FakeTokenizer.vocab_size})")
        opts = (return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs)
        if stream:
            assert not is_batch and params[0].n == 1
            return self._stream(ids_list[0], params[0], opts, rid or "r", cache_salt)
        outs = []
        for i, (ids, sp) in enumerate(zip(ids_list, params, strict=True)):
            one_rid = rid[i] if isinstance(rid, list) else (rid or f"r{i}")
            runs = [self._collect(ids, sp, opts, f"{one_rid}", cache_salt) for _ in range(sp.n)]
            got = await asyncio.gather(*runs)
            outs.append(got if sp.n > 1 else got[0])
        return outs if is_batch else outs[0]

    async def async_generate_calls(self, calls: list[dict[str, Any]]) -> list[Any]:
        """Engine.async_generate_calls: the calls run together, one result each; a call that
        fails ends the others (the fake checks a prompt only once its call runs)."""
        tasks = [asyncio.ensure_future(self.async_generate(**call)) for call in calls]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task, call in zip(tasks, calls, strict=True):
                if not task.done():
                    task.cancel()
                    self.abort(call["rid"])
            raise

    # ---- internals ----------------------------------------------------------------------
    async def _collect(self, ids: list[int], sp: SamplingParams, opts: tuple, rid: str,
                       cache_salt: str | None) -> dict:
        out: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}
        lps: list = []
        async for chunk in self._stream(ids, sp, opts, rid, cache_salt):
            out["text"] += chunk["text"]
            out["output_ids"] += chunk["output_ids"]
            lps += chunk["meta_info"].get("output_token_logprobs", [])
            out["meta_info"] = chunk["meta_info"]
        if opts[0]:
            out["meta_info"]["output_token_logprobs"] = lps
            out["meta_info"]["output_top_logprobs"] = [
                [[-1.0, t, chr(t)] for t in range(97, 97 + opts[2])] for _ in lps] if opts[2] else (
                [None] * len(lps))
        return out

    async def _stream(self, ids: list[int], sp: SamplingParams, opts: tuple,
                      rid: str, cache_salt: str | None = None) -> AsyncIterator[dict]:
        want_lp, start, num_top, with_text = opts
        key = (cache_salt, *ids)  # like the engine's tree: no prefix shared across salts
        cached = len(ids) - 1 if key in self.seen_prompts else 0
        self._num_waiting += 1
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0,
                                "cached_tokens": cached, "finish_reason": None,
                                "e2e_latency": 0.0, "queue_time": 0.0}
        held = 0
        is_running = False
        try:
            async with self._running:
                self._num_waiting -= 1
                self._num_running += 1
                is_running = True
                self.used_slots += len(ids)
                held = len(ids)
                self._num_prompt += len(ids)
                self._num_cached += cached
                if want_lp:
                    first = max(start, 0)
                    meta["input_token_logprobs"] = [
                        [None if i == 0 else -2.0, t, chr(t) if with_text else None]
                        for i, t in enumerate(ids[first:], start=first)]
                # like the engine, a sequence ends at the context length
                num_new = min(sp.max_new_tokens, self.server_args.context_length - len(ids))
                for i in range(num_new):
                    await asyncio.sleep(self.step_s)
                    tok = 97 + (len(ids) + i) % 26
                    self.used_slots += 1
                    held += 1
                    meta = {**meta, "completion_tokens": i + 1}
                    if i + 1 == num_new:
                        meta["finish_reason"] = {"type": "length", "length": num_new}
                    chunk_meta = dict(meta)
                    if want_lp:
                        chunk_meta["output_token_logprobs"] = [[-1.0, tok, chr(tok) if with_text
                                                                 else None]]
                    yield {"text": chr(tok), "output_ids": [tok], "meta_info": chunk_meta}
                if num_new == 0:
                    meta["finish_reason"] = {"type": "length", "length": 0}
                    yield {"text": "", "output_ids": [], "meta_info": meta}
                self.seen_prompts.add(key)
                self.used_slots -= held
                self.cached_slots += len(ids) if cached == 0 else 0
                held = 0
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.add(rid)
            raise
        finally:
            self.used_slots -= held
            if is_running:
                self._num_running -= 1
            else:
                self._num_waiting -= 1
