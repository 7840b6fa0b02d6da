"""Engine: the user's handle on the runtime — tokenize, validate, submit, stream results.

The scheduler and the model run in an engine-core process of their own (SGLang's shape; see
sglang_like.engine_core), so a program's own threads, tokenizing and an HTTP server never take
the GIL from the decode loop. `engine_in_process=True` runs the same core on a thread instead.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import ipaddress
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sglang_like.config import EMBEDDING_POOLINGS, ServerArgs
from sglang_like.engine_core.io import RequestHandle, encode_prompt, prepare_inputs
from sglang_like.engine_core.messages import GenerateReqInput, ImageItem, encode
from sglang_like.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """An LLM engine. `generate` / `async_generate` / `chat` are thread-safe; the engine core
    (scheduler, model runner) runs in its own process, or on one thread of this process with
    `engine_in_process=True`, and owns every request's state."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        server_args = kwargs.pop("server_args", None) or ServerArgs(model_path=model_path, **kwargs)
        t0 = time.perf_counter()
        self._closed = False
        if server_args.engine_in_process:
            from sglang_like.engine_core.local import ThreadCoreClient

            self._client: Any = ThreadCoreClient(server_args)
        else:
            from sglang_like.engine_core.client import ProcessCoreClient

            self._client = ProcessCoreClient(server_args)
        info = self._client.info
        self.server_args, self.model_config = info.server_args, info.model_config
        self.device, self.dtype = info.device, info.dtype
        self.eos_token_ids = info.eos_token_ids
        self.loop_cpu = info.loop_cpu  # the core the engine loop has to itself, if any
        self.tokenizer = self._client.tokenizer
        self._lock = threading.Lock()
        self._prompter: Any = False  # loaded on first use (image_prompter)
        # names of the loaded LoRA adapters (a request naming another is refused here, 400)
        self._lora_names: set[str] = (
            {a["name"] for a in self._client.call("list_lora_adapters")}
            if self.server_args.enable_lora else set())
        _live_engines.add(self)
        logger.info(
            "loaded %s (%s, %d layers) on %s/%s, weights %s (%.0f MB) in %.1fs; KV pool %d "
            "slots (%s), context %d; engine core %s",
            self.model_config.model_path or "model", self.model_config.architecture,
            self.model_config.num_hidden_layers, self.device, self.dtype,
            self.server_args.quantization, info.weight_bytes / 1e6,
            time.perf_counter() - t0, self.server_args.max_total_tokens,
            self.server_args.kv_cache_dtype, self.server_args.context_length,
            "in this process" if server_args.engine_in_process
            else f"in process {self._client.proc.pid}",
        )

    # ---- the core, for tests and tools that look inside (engine_in_process=True only) ------
    @property
    def scheduler(self) -> Any:
        return self._local_core().scheduler

    @property
    def runner(self) -> Any:
        return self._local_core().runner

    def _local_core(self) -> Any:
        core = getattr(self._client, "core", None)
        if core is None:
            raise AttributeError("the scheduler and model runner live in the engine process; "
                                 "build the Engine with engine_in_process=True to reach them")
        return core

    @property
    def engine_pid(self) -> int | None:
        """The engine-core process's pid (None when the core runs in this process)."""
        proc = getattr(self._client, "proc", None)
        return None if proc is None else proc.pid

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
        bootstrap_host: str | list[str] | None = None,
        bootstrap_port: int | list[int] | None = None,
        bootstrap_room: int | list[int] | None = None,
        cache_salt: str | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        pooling: str | None = None,
        priority: int | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict), a list (a list of dicts), or stream increments.
        `cache_salt`: requests of different salts share no cached prefix (tenants).
        `lora_path`: the name of a loaded LoRA adapter to run on (SGLang's field), or one per
        prompt of a batch (None: the base model).
        `image_data` (a vision-language model): an image or a list of them for a text prompt
        that names each with the model's placeholder (`<image>`), or one such per prompt of a
        batch; an image is a data: or http(s) URL, base64, bytes, a PIL image, or a local path
        under `allowed_local_media_path`.
        `pooling` ("last" | "mean"): an embedding request (see `encode`).
        `priority` (with `enable_priority_scheduling`; SGLang's and vLLM's field): the place
        in the queue of the request (of every prompt of a batch): a higher value first, or a
        lower one with `schedule_low_priority_values_first`. Without it: None or 0 only."""
        try:
            reqs, is_batch = self._make_reqs(
                prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, stream, rid, (bootstrap_host, bootstrap_port, bootstrap_room),
                cache_salt, lora_path, image_data, pooling, priority)
        except ValueError as exc:
            self._refuse_pd_rooms((bootstrap_host, bootstrap_port, bootstrap_room), exc)
            raise
        handles = self._submit(reqs, return_text_in_logprobs, None)
        if stream:
            return self._stream_sync(handles[0], is_batch)
        results = [_raise_bad_input(h.wait_final(), is_batch) for h in handles]
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
        bootstrap_host: str | list[str] | None = None,
        bootstrap_port: int | list[int] | None = None,
        bootstrap_room: int | list[int] | None = None,
        cache_salt: str | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        pooling: str | None = None,
        priority: int | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """The asyncio form of `generate`; with stream=True, an async iterator of increments.
        A text prompt is tokenized on a thread of the engine's, not on the event loop, which
        streams every other request's tokens meanwhile."""
        loop = asyncio.get_running_loop()
        reqs, is_batch = await self._async_reqs(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, stream, rid, bootstrap_host, bootstrap_port, bootstrap_room,
            cache_salt, lora_path, image_data, pooling, priority)
        handles = self._submit(reqs, return_text_in_logprobs, loop)
        if stream:
            return self._stream_async(handles[0], is_batch)
        try:
            results = [_raise_bad_input(await h.async_final(), is_batch) for h in handles]
        except asyncio.CancelledError:
            for h in handles:
                self.abort(h.rid)
            raise
        return results if is_batch else results[0]

    async def async_generate_calls(self, calls: list[dict[str, Any]]) -> list[dict | list[dict]]:
        """Several non-streamed `async_generate` calls, each a dict of its keyword arguments,
        whose requests reach the core together as one call's prompts do (the OpenAI server's
        list of prompts, or its n choices): one result per call. A call refused as bad input
        raises before any is submitted; a failure after that aborts every call's requests."""
        if any(call.get("stream") for call in calls):
            raise ValueError("async_generate_calls takes non-streamed calls")
        loop = asyncio.get_running_loop()
        made = []
        for call in calls:
            call = dict(call)
            text = call.pop("return_text_in_logprobs", False)
            reqs, is_batch = await self._async_reqs(**call)
            made.append((reqs, is_batch, self._new_handles(reqs, text, loop)))
        self._client.submit([r for reqs, _, _ in made for r in reqs],
                            [h for _, _, handles in made for h in handles])

        async def final(is_batch: bool, handles: list[RequestHandle]) -> dict | list[dict]:
            outs = [_raise_bad_input(await h.async_final(), is_batch) for h in handles]
            return outs if is_batch else outs[0]

        waits = [asyncio.ensure_future(final(is_batch, handles)) for _, is_batch, handles in made]
        try:
            return list(await asyncio.gather(*waits))
        except BaseException:  # a cancelled caller, or one call's bad input: end them all now
            for wait in waits:
                wait.cancel()
            for _, _, handles in made:
                for h in handles:
                    self.abort(h.rid)
            raise

    async def _async_reqs(self, prompt: Any = None, sampling_params: Any = None,
                          input_ids: Any = None, return_logprob: bool = False,
                          logprob_start_len: int = -1, top_logprobs_num: int = 0,
                          stream: bool = False, rid: Any = None, bootstrap_host: Any = None,
                          bootstrap_port: Any = None, bootstrap_room: Any = None,
                          cache_salt: str | None = None, lora_path: Any = None,
                          image_data: Any = None, pooling: str | None = None,
                          priority: int | None = None) -> tuple[list[GenerateReqInput], bool]:
        """async_generate's requests: a text prompt tokenized on the engine's threads; a
        refused call's PD rooms are refused too before the ValueError is raised."""
        bootstrap = (bootstrap_host, bootstrap_port, bootstrap_room)
        make = functools.partial(
            self._make_reqs, prompt, sampling_params, input_ids, return_logprob,
            logprob_start_len, top_logprobs_num, stream, rid, bootstrap, cache_salt, lora_path,
            image_data, pooling, priority)
        loop = asyncio.get_running_loop()
        try:
            if prompt is None:
                return make()
            return await loop.run_in_executor(self._tokenize_pool(), make)
        except ValueError as exc:
            await loop.run_in_executor(None, self._refuse_pd_rooms, bootstrap, exc)
            raise

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None,
               pooling: str | None = None, **kwargs: Any) -> dict | list[dict]:
        """Embeddings (SGLang's `Engine.encode`): each prompt prefilled, nothing generated, its
        final hidden states (after the model's norm) pooled ("last": the last token's, the
        default of decoder embedding models; "mean") and L2-normalized. One dict
        {"embedding": [...], "meta_info": {...}} per prompt (a list for a batch); the pooling
        default is the server's `embedding_pooling`. `image_data`, `lora_path`, `rid` and
        `cache_salt` as in `generate`."""
        out = self.generate(prompt, {"max_new_tokens": 0}, input_ids,
                            pooling=pooling or self.server_args.embedding_pooling, **kwargs)
        items = out if isinstance(out, list) else [out]
        done = [{"embedding": o["embedding"], "meta_info": o["meta_info"]} for o in items]
        return done if isinstance(out, list) else done[0]

    def chat(self, messages: list[dict], sampling_params: dict | None = None,
             **kwargs: Any) -> dict | Iterator[dict]:
        """Apply the model's chat template to `messages` and generate the assistant turn.
        A message's content may be a list of parts: {"type": "text", "text": ...} and, for a
        vision-language model, {"type": "image", "image": <any form `image_data` takes>}."""
        images = [part.get("image") for m in messages if isinstance(m.get("content"), list)
                  for part in m["content"] if isinstance(part, dict)
                  and part.get("type") == "image"]
        if images:
            kwargs["image_data"] = images
        return self.generate(self.apply_chat_template(messages), sampling_params, **kwargs)

    @property
    def image_prompter(self) -> Any:
        """The served model's image preprocessing and prompt expansion
        (multimodal.processor.ImagePrompter); None when it reads text only."""
        if self._prompter is False and self.model_config.vision is None:
            self._prompter = None  # a text model: nothing to load (nor PIL to import)
        if self._prompter is False:
            from sglang_like.multimodal.processor import load_prompter

            self._prompter = load_prompter(self.model_config.model_path,
                                           self.model_config.vision, self.model_config.vocab_size)
        return self._prompter

    def apply_chat_template(self, messages: list[dict], tools: Any = None) -> str:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tools=tools)

    def abort(self, rid: str) -> None:
        """End a request now (queued or running), and the ones derived from its rid: the
        samples of n > 1 (`rid-0`, `rid-1`, ...) and the items of a batch given one rid."""
        self._client.abort(rid)

    def abort_all(self) -> None:
        """End every queued and running request (each caller gets an abort, "aborted")."""
        self._client.abort(None)

    def check_health(self) -> str | None:
        """None while the engine serves; otherwise why not: its process or loop died or was
        stopped, or one scheduler step has run past `watchdog_timeout` (a stuck forward)."""
        return self._client.check_health()

    def _refuse_pd_rooms(self, bootstrap: tuple[Any, Any, Any], exc: ValueError) -> None:
        """A PD request refused here (a 400): the other worker of its pair is told now, not
        after its transfer timeout, and the error, raised from `exc`, names this worker's
        role. Returns (the caller re-raises `exc`) when no valid room was given."""
        rooms = _refusable_rooms(bootstrap, self.server_args.disaggregation_allowed_peers)
        if not rooms:
            return
        try:
            mode = self._client.call("refuse_bootstrap_rooms", rooms=rooms, message=str(exc))
        except Exception:  # noqa: BLE001 - the request's own error is the one to report
            logger.exception("could not refuse bootstrap rooms %s", rooms)
            return
        if mode in ("prefill", "decode"):
            raise ValueError(f"this {mode} worker refuses the request: {exc}") from exc

    def flush_cache(self) -> bool:
        """Empty the radix cache; False while requests are queued or running."""
        return self._client.call("flush_cache")

    def switch_disaggregation_mode(self, mode: str, bootstrap_port: int | None = None,
                                   drain_timeout: float = 60.0) -> dict[str, Any]:
        """Make this a prefill, decode or regular ("null") worker without reloading the model,
        once no transfer of its current role is in flight (waits up to `drain_timeout` s;
        the answer's `switched` says whether it happened)."""
        deadline = time.monotonic() + drain_timeout
        while True:
            result = self._client.call("switch_disaggregation_mode", mode=mode,
                                       bootstrap_port=bootstrap_port)
            if result["switched"] or time.monotonic() >= deadline:
                return result
            time.sleep(0.05)

    def get_server_info(self) -> dict[str, Any]:
        """The resolved server args and the scheduler's live counters (asked of the core)."""
        return self._client.call("get_server_info")

    def get_load(self) -> dict[str, int]:
        """What SGLang's /get_load reports for one data-parallel rank: `num_reqs` (running and
        waiting), `num_waiting_reqs`, and `num_tokens` (KV slots the running requests hold)."""
        return self._client.call("get_load")

    # ---- looking inside the cache (the dashboard's data; nothing here changes the tree) ----
    def get_stats(self) -> dict[str, Any]:
        """This moment's counters and gauges: KV pool (free / evictable / locked / used),
        requests, prompt / cached / generated tokens, evictions, and request latency
        percentiles over the last minute. Cheap enough to ask every second."""
        return self._client.call("get_stats")

    def cache_tree(self, max_nodes: int = 500, edge_tokens: int = 32, next_evict: int = 16,
                   rows: bool = False, known_id: int | None = None) -> dict[str, Any]:
        """The radix tree, bounded: the `max_nodes` nodes with the most tokens beneath them
        (see `radix_cache.snapshot.snapshot`), token ids only (`edge_tokens` per edge).

        A fresh snapshot is taken at most once per 100x its cost (`EngineCore.cache_tree`);
        `snapshot_id` names it. `rows=True` leaves the nodes as rows of `fields`; with
        `known_id` (and rows) an unchanged snapshot answers `{"unchanged": True}` only."""
        from radix_cache.snapshot import expand

        tree = self._client.call("cache_tree", max_nodes=max_nodes, edge_tokens=edge_tokens,
                                 next_evict=next_evict, known_id=known_id if rows else None)
        return tree if rows else expand(tree)

    def cache_node(self, node_id: int) -> dict[str, Any] | None:
        """One tree node in full (its prefix from the root, holders), or None if gone."""
        return self._client.call("cache_node", node_id=node_id)

    def cache_match(self, input_ids: list[int]) -> dict[str, Any]:
        """How much of `input_ids` the cache holds and where the match ends, without running
        it or counting a hit."""
        return self._client.call("cache_match", input_ids=list(input_ids))

    @property
    def num_queued_requests(self) -> int:
        return self._client.num_queued

    def attach_event_loop(self, loop: Any) -> bool:
        """Route this engine's outputs on `loop` (call on its thread; a server's) instead of
        a thread of the engine client's: where the core is a process, its outputs are then
        read where they are streamed out, with no thread hop per token. False where nothing
        changed (an in-process core, or one gone). `detach_event_loop` before the loop ends."""
        attach = getattr(self._client, "attach_event_loop", None)
        return bool(attach is not None and attach(loop))

    def detach_event_loop(self) -> None:
        detach = getattr(self._client, "detach_event_loop", None)
        if detach is not None:
            detach()

    def _tokenize_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread: tokenizers are not all safe to call from several threads at once."""
        with self._lock:
            pool = getattr(self, "_tokenizer_thread", None)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="sglang-like-tokenize")
                self._tokenizer_thread = pool
            return pool

    def shutdown(self) -> None:
        """Abort what is in flight (each caller gets "server shutting down") and stop the
        engine core."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool = getattr(self, "_tokenizer_thread", None)
        _live_engines.discard(self)
        self._client.shutdown()
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- LoRA adapters -----------------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False
                          ) -> dict[str, Any]:
        """Read the PEFT adapter at `lora_path` (here, off the engine loop) and serve it as
        `lora_name`; its info, with `evicted`: adapters unloaded to make room
        (`max_loaded_loras`). ValueError when it cannot be served; nothing changes then."""
        from sglang_like.lora import read_adapter

        self._check_lora_enabled()
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError("lora_name must be a non-empty string")
        with self._lock:
            if lora_name in self._lora_names:
                raise ValueError(f"a LoRA adapter named {lora_name!r} is already loaded; "
                                 f"unload it first")
        sa = self.server_args
        adapter = read_adapter(lora_name, lora_path, self.model_config,
                               max_rank=sa.max_lora_rank, target_modules=sa.lora_target_modules)
        info = self._client.call("install_lora_adapter", payload=adapter.to_payload(),
                                 pinned=bool(pinned))
        with self._lock:
            self._lora_names.add(lora_name)
            self._lora_names.difference_update(info["evicted"])
        return info

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Stop serving `lora_name`: requests running on it finish on it; later ones naming it
        are refused. ValueError when no such adapter is loaded."""
        self._check_lora_enabled()
        info = self._client.call("unload_lora_adapter", name=lora_name)
        with self._lock:
            self._lora_names.discard(lora_name)
        return info

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, rank, alpha, targets, bytes, pinned, in_flight."""
        return self._client.call("list_lora_adapters")

    def _check_lora_enabled(self) -> None:
        if not self.server_args.enable_lora:
            raise ValueError("LoRA is not enabled (start with enable_lora=True / --enable-lora "
                             "or --lora-paths)")

    def _lora_per_item(self, lora_path: Any, num_items: int, is_batch: bool) -> list[str | None]:
        """Each prompt's adapter name (None: the base), checked against the loaded ones."""
        if lora_path is None:
            return [None] * num_items
        if isinstance(lora_path, list):
            if not is_batch or len(lora_path) != num_items:
                raise ValueError("lora_path must be a name, or a list with one entry per "
                                 "prompt of a batch")
            names = list(lora_path)
        else:
            names = [lora_path] * num_items
        if any(n is not None and not isinstance(n, str) for n in names):
            raise ValueError("lora_path entries must be adapter names (strings) or null")
        names = [n or None for n in names]
        if any(n is not None for n in names):
            self._check_lora_enabled()
            with self._lock:
                unknown = next((n for n in names if n is not None and n not in self._lora_names),
                               None)
                loaded = sorted(self._lora_names)
            if unknown is not None:
                raise ValueError(f"LoRA adapter {unknown!r} is not loaded (loaded: "
                                 f"{', '.join(loaded) or 'none'})")
        return names

    # ---- requests --------------------------------------------------------------------------
    def _make_reqs(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool,
                   logprob_start_len: int, top_logprobs_num: int, stream: bool,
                   rid: Any, bootstrap: tuple[Any, Any, Any] = (None, None, None),
                   cache_salt: str | None = None, lora_path: Any = None,
                   image_data: Any = None, pooling: str | None = None,
                   priority: int | None = None) -> tuple[list[GenerateReqInput], bool]:
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        priority = self._check_priority(priority)
        if pooling is not None and pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(EMBEDDING_POOLINGS)}, got "
                             f"{pooling!r}")
        if pooling is None and self.server_args.is_embedding:
            raise ValueError("this server serves embeddings (--is-embedding): use "
                             "/v1/embeddings or /encode")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        images: list[list[ImageItem] | None] | None = None
        if image_data is not None:
            input_ids, images = self._image_prompts(prompt, input_ids, image_data)
            prompt = None
        items, is_batch = prepare_inputs(self.tokenizer, prompt, input_ids, sampling_params, rid)
        pd = _bootstrap_per_item(bootstrap, len(items), is_batch)
        loras = self._lora_per_item(lora_path, len(items), is_batch)
        reqs: list[GenerateReqInput] = []
        for k, (ids, sp_dict, item_rid) in enumerate(items):
            sp = SamplingParams.from_dict(sp_dict)
            sp.validate(self.model_config.vocab_size)
            if pooling is not None and (sp.max_new_tokens != 0 or sp.n != 1):
                raise ValueError("an embedding request generates nothing: max_new_tokens 0, "
                                 "n 1")
            item_images = images[k] if images else None
            self._check_lengths(ids, sp, return_logprob, logprob_start_len, top_logprobs_num,
                                item_images)
            host, port, room = pd[k]
            if room is not None and item_images:
                raise ValueError("a disaggregated (bootstrap_room) request cannot carry images "
                                 "yet")
            if room is not None and sp.n != 1:
                raise ValueError("n > 1 is not supported for a disaggregated (bootstrap_room) "
                                 "request")
            if room is not None:
                check_bootstrap_peer(host, self.server_args.disaggregation_allowed_peers)
            base = item_rid or uuid.uuid4().hex
            for i in range(sp.n):
                sp_i = sp if sp.n == 1 else sp.replace_for_sample(i)
                reqs.append(GenerateReqInput(
                    base if sp.n == 1 else f"{base}-{i}", list(ids), sp_i.to_dict(),
                    return_logprob=bool(return_logprob), logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, stream=bool(stream),
                    arrival_time=time.perf_counter(), bootstrap_host=host,
                    bootstrap_port=port, bootstrap_room=room, cache_salt=cache_salt or None,
                    lora_name=loras[k], images=item_images, pooling=pooling,
                    priority=priority))
        for msg in reqs:  # all or none: a field the wire cannot carry fails before any submit
            try:
                encode(msg)
            except (OverflowError, TypeError, ValueError) as exc:
                raise ValueError(f"a request field is out of range: {exc}") from exc
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            dup = next(r for r in rids if rids.count(r) > 1)
            raise ValueError(f"rid {dup!r} is given to more than one request")
        if stream and len(reqs) != 1:  # checked before anything is submitted
            raise ValueError("stream=True takes a single prompt with n=1")
        if len(reqs) > 1 and not is_batch:
            is_batch = True  # n > 1 on one prompt returns a list
        return reqs, is_batch

    def _check_priority(self, priority: Any) -> int:
        """A request's priority (None: 0). One that would order anything needs priority
        scheduling on: refused where it is off, never silently dropped."""
        if priority is None:
            return 0
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {type(priority).__name__}")
        if not -(1 << 63) <= priority < 1 << 63:
            raise ValueError("priority must fit in 64 bits")
        if priority != 0 and not self.server_args.enable_priority_scheduling:
            raise ValueError("priority needs priority scheduling, which is off: start the "
                             "server with --enable-priority-scheduling (Engine("
                             "enable_priority_scheduling=True))")
        return priority

    def _check_lengths(self, ids: list[int], sp: SamplingParams, return_logprob: bool,
                       logprob_start_len: int, top_logprobs_num: int,
                       images: list[ImageItem] | None = None) -> None:
        ctx = self.server_args.context_length
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {ctx}, "
                             "which must also leave room for at least one new token")
        vocab = self.model_config.vocab_size
        if images:  # image positions hold pad ids past the vocabulary, put there by us
            pads = {item.pad_value for item in images}
            ids = [0 if t in pads else t for t in ids]
            first = min(s for item in images for s, _ in item.runs)
            if return_logprob and 0 <= logprob_start_len <= first:
                raise ValueError(f"prompt logprobs cannot cover image positions: give "
                                 f"logprob_start_len > {first} (the first image token)")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or >= 0, got {logprob_start_len!r}")
        if return_logprob and logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len {logprob_start_len} is beyond the prompt "
                             f"({len(ids)} tokens)")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 100:
            raise ValueError(f"top_logprobs_num must be in [0, 100], got {top_logprobs_num!r}")

    def _image_prompts(self, prompt: Any, input_ids: Any, image_data: Any
                       ) -> tuple[list[int] | list[list[int]], list[list[ImageItem] | None]]:
        """(prompt ids with image pad values, each prompt's images) of text prompts whose
        placeholders name `image_data`'s images, one list per prompt of a batch."""
        name = self.server_args.served_model_name or self.model_config.model_path or "model"
        if self.image_prompter is None:
            raise ValueError(f"the model {name!r} reads text only; it takes no image input "
                             "(image_data)")
        if input_ids is not None or prompt is None:
            raise ValueError("image_data needs a text prompt (with the image placeholder "
                             f"{self.image_prompter.placeholder!r}), not input_ids")
        is_batch = isinstance(prompt, list)
        prompts = prompt if is_batch else [prompt]
        if is_batch:
            if not isinstance(image_data, list) or len(image_data) != len(prompts):
                raise ValueError("for a batch of prompts, image_data must be a list with one "
                                 "entry (an image, a list of images, or null) per prompt")
            per_prompt = list(image_data)
        else:
            per_prompt = [image_data]
        from sglang_like.multimodal.images import ImageLimits, load_image

        domains = self.server_args.allowed_media_domains
        limits = ImageLimits(allowed_local_path=self.server_args.allowed_local_media_path,
                             allowed_domains=None if domains is None else tuple(
                                 d.lower() for d in domains))
        cap = self.server_args.limit_mm_per_prompt
        id_lists, images = [], []
        for text, data in zip(prompts, per_prompt, strict=True):
            if not isinstance(text, str):
                raise ValueError("the prompt must be a string or a list of strings")
            data = [] if data is None else data if isinstance(data, list) else [data]
            if len(data) > cap:
                raise ValueError(f"a prompt takes at most {cap} images; it has {len(data)}")
            pictures = [load_image(d, limits) for d in data]
            ids, spans = self.image_prompter.build(
                text, pictures, functools.partial(encode_prompt, self.tokenizer))
            id_lists.append(ids)
            whole = self.image_prompter.vision.bidirectional
            images.append([ImageItem(sp.hash, sp.pad_value, sp.runs, sp.pixel_values.tobytes(),
                                     tuple(sp.pixel_values.shape), whole) for sp in spans]
                          or None)
        return (id_lists if is_batch else id_lists[0]), images

    @property
    def grammar_backend(self) -> Any:
        """The constraint backend (xgrammar or outlines) over this model's vocabulary."""
        return self._client.grammar_backend

    # ---- the loop --------------------------------------------------------------------------
    def _submit(self, reqs: list[GenerateReqInput], text_in_logprobs: bool,
                loop: asyncio.AbstractEventLoop | None) -> list[RequestHandle]:
        """One call's requests, submitted together (the core schedules them as one arrival)."""
        handles = self._new_handles(reqs, text_in_logprobs, loop)
        self._client.submit(reqs, handles)
        return handles

    def _new_handles(self, reqs: list[GenerateReqInput], text_in_logprobs: bool,
                     loop: asyncio.AbstractEventLoop | None) -> list[RequestHandle]:
        handles = [RequestHandle(req.rid, req.stream, loop) for req in reqs]
        if text_in_logprobs:
            for handle in handles:
                handle.logprob_tokenizer = self.tokenizer
        return handles

    def _stream_sync(self, handle: RequestHandle, is_batch: bool) -> Iterator[dict]:
        try:
            while True:
                chunk = _raise_bad_input(handle.next_sync(), is_batch)
                yield chunk
                if chunk["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not handle.done:
                self.abort(handle.rid)

    async def _stream_async(self, handle: RequestHandle, is_batch: bool) -> AsyncIterator[dict]:
        try:
            while True:
                chunk = _raise_bad_input(await handle.next_async(), is_batch)
                yield chunk
                if chunk["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not handle.done:
                self.abort(handle.rid)


def check_bootstrap_peer(host: str | None, allowed: tuple[str, ...]) -> None:
    """A ValueError (a 400) unless `host` (None: loopback) is a loopback address or one of
    `allowed`: a decode worker connects to the prefill side a request names, so a client must
    not make it reach any host it likes (the peer's secret is checked only once connected)."""
    if host is None or host in allowed or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"bootstrap_host {host!r} is not an allowed prefill peer of this worker "
                     "(--disaggregation-allowed-peers)")


def _bootstrap_per_item(bootstrap: tuple[Any, Any, Any], num_items: int,
                        is_batch: bool) -> list[tuple[Any, Any, Any]]:
    """(host, port, room) for each prompt: lists (one entry per prompt) for a batch, as
    sglang-router's PD mode sends them, or scalars for one prompt."""
    columns = []
    for name, value in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), bootstrap,
                           strict=True):
        if isinstance(value, list):
            if not is_batch or len(value) != num_items:
                raise ValueError(f"{name} must be a list with one entry per prompt exactly "
                                 "when the input is a batch")
            columns.append(value)
        else:
            if value is not None and is_batch and num_items > 1:
                raise ValueError(f"{name} must be a list with one entry per prompt")
            columns.append([value] * num_items)
    for room in columns[2]:
        if room is not None and not (isinstance(room, int) and 0 <= room < 1 << 63):
            raise ValueError(f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
    for port in columns[1]:
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"bootstrap_port must be a port number, got {port!r}")
    return list(zip(*columns, strict=True))


def _refusable_rooms(bootstrap: tuple[Any, Any, Any], allowed: tuple[str, ...]
                     ) -> list[tuple[str, int, int]]:
    """The well-formed (host, port, room) entries of a refused request's bootstrap fields,
    with the defaults the core applies; hosts this worker may not reach are left out."""
    host, port, room = bootstrap
    rooms = room if isinstance(room, list) else [room]
    hosts = host if isinstance(host, list) and len(host) == len(rooms) else [host] * len(rooms)
    ports = port if isinstance(port, list) and len(port) == len(rooms) else [port] * len(rooms)
    out = []
    for h, p, r in zip(hosts, ports, rooms, strict=True):
        h, p = h or "127.0.0.1", p or 8998
        if not (isinstance(r, int) and 0 <= r < 1 << 63 and isinstance(h, str)
                and isinstance(p, int) and 0 < p < 65536):
            continue
        try:
            check_bootstrap_peer(h, allowed)
        except ValueError:
            continue
        out.append((h, p, r))
    return out


def _raise_bad_input(out: dict, is_batch: bool) -> dict:
    """A single request that the core refused as bad input (an invalid grammar) is a
    ValueError, as every other bad input is; inside a batch it ends alone, as an abort."""
    reason = out["meta_info"]["finish_reason"]
    if not is_batch and reason is not None and reason.get("status_code") == 400:
        raise ValueError(reason.get("message") or "bad request")
    return out


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    """A program that ends without `shutdown()` still stops its engine processes cleanly."""
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.debug("engine shutdown at exit failed", exc_info=True)
