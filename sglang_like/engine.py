"""Engine: the runtime in this process — tokenize, queue, run the scheduler loop, stream results."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sglang_like.config import ServerArgs
from sglang_like.cpu_runtime import release_openmp_threads, trim_heap
from sglang_like.engine_io import RequestHandle, prepare_inputs
from sglang_like.engine_loop import EngineLoop
from sglang_like.engine_setup import build_engine_parts
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 60.0


class Engine:
    """An LLM engine in this process. `generate` / `async_generate` / `chat` are thread-safe;
    one background thread runs the scheduler loop and owns every request's state."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        server_args = kwargs.pop("server_args", None) or ServerArgs(model_path=model_path, **kwargs)
        t0 = time.perf_counter()
        # Every torch op of the engine (load, forward, sampling) runs on the loop thread: a
        # second thread with its own OpenMP team oversubscribes the cores, and GNU OpenMP
        # then stops spinning between parallel regions (each matmul pays a wake-up; measured
        # 2x slower decode on 2 cores). The caller's own team, if it made one, is let go.
        release_openmp_threads()
        ready: queue.Queue[BaseException | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._main, args=(server_args, ready),
                                        name="sglang-like-scheduler", daemon=True)
        self._thread.start()
        error = ready.get()
        if error is not None:
            self._thread.join()
            raise error
        logger.info(
            "loaded %s (%s, %d layers) on %s/%s, weights %s (%.0f MB) in %.1fs; KV pool %d "
            "slots (%s), context %d",
            self.model_config.model_path or "model", self.model_config.architecture,
            self.model_config.num_hidden_layers, self.device, self.server_args.dtype,
            self.server_args.quantization, self.runner.model.weight_bytes() / 1e6,
            time.perf_counter() - t0, self.server_args.max_total_tokens,
            self.server_args.kv_cache_dtype, self.server_args.context_length,
        )

    def _main(self, server_args: ServerArgs, ready: queue.Queue) -> None:
        """The loop thread: build the model and scheduler here, then serve."""
        try:
            self._build(server_args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__ in the caller
            ready.put(exc)
            return
        trim_heap()  # the loader's temporaries
        ready.put(None)
        self._core.run()

    def _build(self, server_args: ServerArgs) -> None:
        parts = build_engine_parts(server_args)
        self.server_args, self.device, self.dtype = parts.server_args, parts.device, parts.dtype
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self._grammar_backend: Any = None
        self._grammar_lock = threading.Lock()
        self._core = EngineLoop(self.tokenizer, self.server_args.watchdog_timeout)
        self._core.scheduler = self.scheduler
        self._closed = False

    # ---- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict), a list (a list of dicts), or stream increments."""
        reqs, is_batch = self._make_reqs(prompt, sampling_params, input_ids, return_logprob,
                                         logprob_start_len, top_logprobs_num, stream, rid)
        self._attach_grammars_sync(reqs, is_batch)
        handles = [self._submit(r, return_text_in_logprobs, None) for r in reqs]
        if stream:
            return self._stream_sync(handles[0])
        results = [h.wait_final() for h in handles]
        return results if is_batch else results[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """The asyncio form of `generate`; with stream=True, an async iterator of increments."""
        reqs, is_batch = self._make_reqs(prompt, sampling_params, input_ids, return_logprob,
                                         logprob_start_len, top_logprobs_num, stream, rid)
        await self._attach_grammars_async(reqs, is_batch)
        loop = asyncio.get_running_loop()
        handles = [self._submit(r, return_text_in_logprobs, loop) for r in reqs]
        if stream:
            return self._stream_async(handles[0])
        try:
            results = [await h.async_final() for h in handles]
        except asyncio.CancelledError:
            for h in handles:
                self.abort(h.rid)
            raise
        return results if is_batch else results[0]

    def chat(self, messages: list[dict], sampling_params: dict | None = None,
             **kwargs: Any) -> dict | Iterator[dict]:
        """Apply the model's chat template to `messages` and generate the assistant turn."""
        return self.generate(self.apply_chat_template(messages), sampling_params, **kwargs)

    def apply_chat_template(self, messages: list[dict], tools: Any = None) -> str:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tools=tools)

    def abort(self, rid: str) -> None:
        """End a request now (queued or running), and the ones derived from its rid: the
        samples of n > 1 (`rid-0`, `rid-1`, ...) and the items of a batch given one rid."""
        self._core.put_command("abort", rid)

    def abort_all(self) -> None:
        """End every queued and running request (each caller gets an abort, "aborted")."""
        self._core.put_command("abort_all")

    def check_health(self) -> str | None:
        """None while the engine serves; otherwise why not: its loop died or was stopped, or
        one scheduler step has run past `watchdog_timeout` (a stuck forward)."""
        return self._core.check_health()

    def flush_cache(self) -> bool:
        """Empty the radix cache; False while requests are queued or running."""
        return self._call_in_loop(self.scheduler.flush_cache)

    def get_server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            **{k: v for k, v in vars(self.server_args).items() if k != "api_key"},
            "model_path": self.model_config.model_path,
            "kv_pool": {**s.kv_pool_info(),
                        "bytes_per_slot": self.runner.kv_pool.bytes_per_slot},
            "cache_hit_rate": s.cache_hit_rate,
            "num_running_reqs": len(s.running),
            "num_queued_reqs": len(s.waiting),
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
        """What SGLang's /get_load reports for one data-parallel rank: running and waiting
        requests, and the KV slots the running requests hold (`num_tokens`)."""
        s = self.scheduler
        return {"dp_rank": 0, "num_reqs": len(s.running) + len(s.waiting),
                "num_waiting_reqs": len(s.waiting),
                "num_tokens": s.kv_pool_info()["used_slots"]}

    @property
    def num_queued_requests(self) -> int:
        return len(self.scheduler.waiting) + self._core.num_pending_commands

    def shutdown(self) -> None:
        """Abort what is in flight and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        self._core.put_command("stop")
        self._thread.join(timeout=30)
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------
    def _make_reqs(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool,
                   logprob_start_len: int, top_logprobs_num: int, stream: bool,
                   rid: Any) -> tuple[list[Req], bool]:
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        items, is_batch = prepare_inputs(self.tokenizer, prompt, input_ids, sampling_params, rid)
        reqs: list[Req] = []
        for ids, sp_dict, item_rid in items:
            sp = SamplingParams.from_dict(sp_dict)
            sp.validate(self.model_config.vocab_size)
            self._check_lengths(ids, sp, return_logprob, logprob_start_len, top_logprobs_num)
            base = item_rid or uuid.uuid4().hex
            for i in range(sp.n):
                sp_i = sp if sp.n == 1 else sp.replace_for_sample(i)
                r = Req(base if sp.n == 1 else f"{base}-{i}", list(ids), sp_i,
                        return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num, stream=stream)
                reqs.append(r)
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            dup = next(r for r in rids if rids.count(r) > 1)
            raise ValueError(f"rid {dup!r} is given to more than one request")
        if stream and len(reqs) != 1:  # checked before anything is submitted
            raise ValueError("stream=True takes a single prompt with n=1")
        if len(reqs) > 1 and not is_batch:
            is_batch = True  # n > 1 on one prompt returns a list
        return reqs, is_batch

    def _check_lengths(self, ids: list[int], sp: SamplingParams, return_logprob: bool,
                       logprob_start_len: int, top_logprobs_num: int) -> None:
        ctx = self.server_args.context_length
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {ctx}, "
                             "which must also leave room for at least one new token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or >= 0, got {logprob_start_len!r}")
        if return_logprob and logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len {logprob_start_len} is beyond the prompt "
                             f"({len(ids)} tokens)")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 100:
            raise ValueError(f"top_logprobs_num must be in [0, 100], got {top_logprobs_num!r}")

    # ---- grammars --------------------------------------------------------------------------
    @property
    def grammar_backend(self) -> Any:
        with self._grammar_lock:
            if self._grammar_backend is None:
                from constrained import GrammarBackend, TokenizerInfo

                info = TokenizerInfo(
                    vocab=self.tokenizer.token_bytes_list(),
                    vocab_size=self.model_config.vocab_size,
                    eos_token_ids=self.eos_token_ids,
                    special_token_ids=self.tokenizer.special_token_ids,
                )
                self._grammar_backend = GrammarBackend(info, self.server_args.grammar_backend)
            return self._grammar_backend

    def _grammar_future(self, req: Req) -> Any:
        kind, spec = req.sampling_params.constraint
        return self.grammar_backend.get_future(kind, spec)

    def _attach_grammars_sync(self, reqs: list[Req], is_batch: bool) -> None:
        # Ask for every compile first so that the distinct specs of a batch compile in parallel.
        pending = [(r, self._grammar_future(r)) for r in reqs
                   if r.sampling_params.constraint is not None]
        for req, future in pending:
            self._attach(req, future.result(_GRAMMAR_WAIT_S), is_batch)

    async def _attach_grammars_async(self, reqs: list[Req], is_batch: bool) -> None:
        pending = [(r, asyncio.wrap_future(self._grammar_future(r))) for r in reqs
                   if r.sampling_params.constraint is not None]
        for req, future in pending:
            self._attach(req, await asyncio.wait_for(future, _GRAMMAR_WAIT_S), is_batch)

    def _attach(self, req: Req, grammar: Any, is_batch: bool) -> None:
        from constrained import InvalidGrammar

        if isinstance(grammar, InvalidGrammar):
            if not is_batch:
                raise ValueError(grammar.message)
            req.invalid_message = grammar.message  # ends alone inside its batch
        else:
            req.grammar = grammar

    # ---- the loop --------------------------------------------------------------------------
    def _submit(self, req: Req, text_in_logprobs: bool,
                loop: asyncio.AbstractEventLoop | None) -> RequestHandle:
        handle = RequestHandle(req.rid, req.stream, loop)
        handle.text_in_logprobs = text_in_logprobs
        self._core.submit(req, handle)
        return handle

    def _stream_sync(self, handle: RequestHandle) -> Iterator[dict]:
        try:
            while True:
                chunk = handle.next_sync()
                yield chunk
                if chunk["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not handle.done:
                self.abort(handle.rid)

    async def _stream_async(self, handle: RequestHandle) -> AsyncIterator[dict]:
        try:
            while True:
                chunk = await handle.next_async()
                yield chunk
                if chunk["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not handle.done:
                self.abort(handle.rid)

    def _call_in_loop(self, fn: Any) -> Any:
        done: queue.Queue = queue.Queue(maxsize=1)
        self._core.put_command("call", (fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value
