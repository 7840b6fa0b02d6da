"""EngineCore: what runs beside the scheduler loop, in the engine-core process or a thread."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radix_cache.namespace import cache_namespace, untag_token
from sglang_like.config import SECRET_SERVER_ARGS, ModelConfig, ServerArgs
from sglang_like.engine_core.loop import EngineLoop, LoopHooks
from sglang_like.engine_core.messages import GenerateReqInput
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams

# The share of the loop's time that radix-tree snapshots may take (see EngineCore.cache_tree).
SNAPSHOT_DUTY = 0.01


def _dashboard_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Count the loop time a dashboard RPC takes (`dashboard_busy_s` in get_stats)."""

    @functools.wraps(fn)
    def timed(self: EngineCore, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.dashboard_busy_s += time.perf_counter() - t0

    return timed


@dataclass(frozen=True)
class CoreInfo:
    """What the Engine learns from its core once the model is loaded."""

    server_args: ServerArgs  # every "auto" resolved
    model_config: ModelConfig
    device: str
    dtype: str
    eos_token_ids: frozenset[int]
    weight_bytes: int
    loop_cpu: int | None = None  # the core the loop's thread has to itself (cpu_pinning)


def make_req(msg: GenerateReqInput) -> Req:
    """The scheduler's request for a message (its fields were validated by the Engine)."""
    req = Req(msg.rid, list(msg.input_ids), SamplingParams(**msg.sampling_params),
              return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
              top_logprobs_num=msg.top_logprobs_num, stream=msg.stream)
    if msg.arrival_time:
        req.arrival_time = msg.arrival_time
    req.cache_namespace = cache_namespace(msg.cache_salt)
    req.lora_name = msg.lora_name  # resolved on the loop thread (Scheduler.add_request)
    req.images = msg.images
    req.pooling = msg.pooling
    req.priority = msg.priority
    if msg.bootstrap_room is not None:
        req.bootstrap = (msg.bootstrap_host or "127.0.0.1",
                         msg.bootstrap_port or 8998, msg.bootstrap_room)
    return req


class EngineCore:
    """The model, its scheduler and the loop that drives them; built on the loop's thread."""

    RPC_METHODS = ("get_server_info", "get_load", "flush_cache", "get_stats", "cache_tree",
                   "cache_node", "cache_match", "switch_disaggregation_mode",
                   "refuse_bootstrap_rooms",
                   "install_lora_adapter", "unload_lora_adapter", "list_lora_adapters")

    def __init__(self, server_args: ServerArgs, hooks: LoopHooks | None = None) -> None:
        from sglang_like.engine_core.setup import build_engine_parts

        parts = build_engine_parts(server_args)
        self.server_args, self.model_config = parts.server_args, parts.model_config
        self.tokenizer, self.runner, self.scheduler = parts.tokenizer, parts.runner, parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self.loras = parts.loras  # None unless LoRA is on
        # the detokenizer's per-token byte table (0.6 s on the default model's tokenizer):
        # built with the engine, not inside the first request's first decode step
        if getattr(self.tokenizer, "is_byte_level", False):
            _ = self.tokenizer.token_bytes
        if not self.server_args.skip_server_warmup:  # before the loop takes any request
            from sglang_like.engine_core.warmup import warm_up

            warm_up(self.scheduler)
        self.info = CoreInfo(
            self.server_args, self.model_config, str(parts.device),
            str(parts.dtype).removeprefix("torch."), self.eos_token_ids,
            int(self.runner.model.weight_bytes()),
        )
        # the last snapshot per parameters: (time, cost, snapshot); a fresh one of any
        # parameters waits for _next_snapshot_at (the one budget all parameters share)
        self._snapshots: dict[tuple, tuple[float, float, dict]] = {}
        self._next_snapshot_at = 0.0
        self._snapshot_ids = 0
        self.dashboard_busy_s = 0.0  # loop time spent answering the dashboard's RPCs
        self._grammar_backend: Any = None
        self._grammar_lock = threading.Lock()
        self.loop = EngineLoop(self.tokenizer, self.server_args.watchdog_timeout,
                               grammar_backend=lambda: self.grammar_backend, hooks=hooks,
                               stream_interval=self.server_args.stream_interval)
        self.loop.scheduler = self.scheduler
        self._kv_transfer: Any = None  # the Mooncake engine, made once, kept across roles
        self.disaggregation_mode = "null"
        self._set_disaggregation_mode(self.server_args.disaggregation_mode,
                                      self.server_args.disaggregation_bootstrap_port)

    @property
    def grammar_backend(self) -> Any:
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = build_grammar_backend(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                    self.server_args.grammar_backend,
                    self.server_args.grammar_compile_memory_mb)
            return self._grammar_backend

    def _set_disaggregation_mode(self, mode: str, bootstrap_port: int) -> None:
        from sglang_like.disaggregation import build_manager

        sa = self.server_args
        if mode != "null" and sa.tp_size > 1:
            raise ValueError("prefill/decode disaggregation with --tp-size > 1 is not "
                             "supported yet")
        if mode != "null" and self.runner.device.type != "cpu":
            # the layer hook fires when a layer's kernels are queued, not done: a GPU sender
            # would first wait on a per-layer event (not written yet)
            raise ValueError("prefill/decode disaggregation runs on CPU workers only so far")
        if mode == "decode" and (sa.speculative_algorithm or "").startswith("EAGLE"):
            # its draft head never sees the prompt it would need the hidden states of
            raise ValueError("a decode worker cannot run EAGLE speculation (the prompt is "
                             "computed elsewhere); use --speculative-algorithm NGRAM")
        if mode != "null" and self._kv_transfer is None:
            from sglang_like.disaggregation.transfer import MooncakeKVTransfer

            self._kv_transfer = MooncakeKVTransfer(self.runner.kv_pool, sa.host)
        secret = None
        if mode != "null":
            from sglang_like.disaggregation.channel import cluster_secret

            secret = cluster_secret(sa.disaggregation_secret)
        manager = build_manager(mode, self._kv_transfer, self.runner.req_to_token_pool,
                                sa.host, bootstrap_port, sa.disaggregation_transfer_timeout,
                                lambda: self.loop.put_command("wake"), secret,
                                self.model_config.vocab_size, loras=self.scheduler.loras)
        old, self.scheduler.disagg = self.scheduler.disagg, manager
        if old is not None:
            old.close()
        self.disaggregation_mode = mode
        self.server_args = sa.replace(disaggregation_mode=mode,
                                      disaggregation_bootstrap_port=bootstrap_port)

    def shutdown_disaggregation(self) -> None:
        if self.scheduler.disagg is not None:
            self.scheduler.disagg.close()

    def shutdown_grammars(self) -> None:
        with self._grammar_lock:
            if self._grammar_backend is not None:
                self._grammar_backend.shutdown()

    # ---- RPC_METHODS: called on the loop thread ---------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            **{k: v for k, v in vars(self.server_args).items() if k not in SECRET_SERVER_ARGS},
            "model_path": self.model_config.model_path,
            "engine_pid": os.getpid(),  # the engine-core process (this one's pid in-process)
            "loop_cpu": self.info.loop_cpu,  # the core the loop keeps to itself (cpu_pinning)
            # CPU decode threads now and the prefill's (--decode-threads); None: no policy
            "cpu_threads": (self.runner.decode_threads.info()
                            if getattr(self.runner, "decode_threads", None) else None),
            "kv_pool": {**s.kv_pool_info(),
                        "bytes_per_slot": self.runner.kv_pool.bytes_per_slot},
            "cache_hit_rate": s.cache_hit_rate,
            **self._counters(),
            # speculative decoding: how many verify passes committed k tokens
            "spec_accept_lengths": dict(sorted(s.spec_accept_lengths.items())),
            # faults injected so far (SGLANG_LIKE_FAULT_INJECT), by site; {} when off
            "injected_faults": s.faults.stats() if s.faults.enabled else {},
            "context_length": self.server_args.context_length,
            "disaggregation": (s.disagg.info() if s.disagg is not None
                               else {"mode": "null"}),
            "lora_adapters": self.list_lora_adapters(),
        }

    # ---- LoRA adapters: read and checked by the Engine, off this thread; a dict insert here
    def _lora_registry(self) -> Any:
        if self.loras is None:
            raise ValueError("LoRA is not enabled on this server (start it with --enable-lora "
                             "or --lora-paths)")
        return self.loras

    def install_lora_adapter(self, payload: dict[str, Any], pinned: bool = False
                             ) -> dict[str, Any]:
        """Serve the adapter `payload` carries (`LoraAdapter.to_payload`); its info and the
        names evicted to make room."""
        from sglang_like.lora import LoraAdapter

        registry = self._lora_registry()
        adapter = LoraAdapter.from_payload(payload).to(self.runner.device)
        evicted = registry.install(adapter, pinned)
        return {**registry.get(adapter.name).info(), "evicted": evicted}

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Stop serving `name`: requests running on it finish on it, new ones are refused."""
        return self._lora_registry().unload(name).info()

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        return [] if self.loras is None else self.loras.info()

    def get_load(self) -> dict[str, int]:
        """What SGLang's /get_load reports for one data-parallel rank: requests (running and
        waiting), waiting requests, and the KV slots the running requests hold."""
        s = self.scheduler
        waiting = len(s.waiting) + self.loop.num_pending_commands
        if s.disagg is not None:  # PD requests meeting their other half, or moving KV
            waiting += s.disagg.num_inflight
        return {"dp_rank": 0, "num_reqs": len(s.running) + waiting,
                "num_waiting_reqs": waiting, "num_tokens": s.kv_pool_info()["used_slots"]}

    def flush_cache(self) -> bool:
        """Empty the radix cache; False while requests are queued or running."""
        return self.scheduler.flush_cache()

    def switch_disaggregation_mode(self, mode: str, bootstrap_port: int | None = None,
                                   ) -> dict[str, Any]:
        """Become a `mode` worker ("prefill", "decode", "null") without reloading the model.
        Refused ({"switched": False}) while transfers of the current role are in flight:
        the caller drains first (see sglang_like.disaggregation.switch_role)."""
        disagg = self.scheduler.disagg
        inflight = disagg.num_inflight if disagg is not None else 0
        if inflight:
            return {"switched": False, "mode": self.disaggregation_mode,
                    "num_inflight": inflight}
        port = bootstrap_port or self.server_args.disaggregation_bootstrap_port
        self._set_disaggregation_mode(mode, port)
        return {"switched": True, "mode": mode, "bootstrap_port": port}

    def refuse_bootstrap_rooms(self, rooms: list[list[Any]], message: str) -> str:
        """PD requests ((host, port, room) each) turned away at this worker's door: the other
        half of each pair is told at once (the managers' `refuse`); this worker's role."""
        if self.scheduler.disagg is not None:
            self.scheduler.disagg.refuse([(h, p, r) for h, p, r in rooms], message)
        return self.disaggregation_mode

    # ---- what the dashboard reads (server/dashboard): small answers, no tree mutation ------
    @_dashboard_call
    def get_stats(self) -> dict[str, Any]:
        """Counters and gauges of this moment, for a 1 Hz sampler: no server args, no tree walk."""
        s = self.scheduler
        tree = s.cache.tree
        return {
            "t": time.monotonic(),
            "kv_pool": {**s.kv_pool_info(), "evictable_slots": tree.evictable_size,
                        "locked_slots": tree.protected_size, **self._pool_format()},
            **self._counters(),
            "num_tree_nodes": tree.num_nodes,
            "evicted_tokens": tree.evicted_tokens,
            "spec_accept_lengths": {str(k): v for k, v in s.spec_accept_lengths.items()},
            "latency": self.loop.request_latency.summary(),
        }

    def _pool_format(self) -> dict[str, Any]:
        """The KV pool's element type (int8 / fp8 codes or a float; the server info's
        kv_cache_dtype) and bytes a token takes over every layer, scales included."""
        pool = self.runner.kv_pool
        return {"dtype": str(pool.k_buffers[0].dtype).removeprefix("torch."),
                "bytes_per_slot": pool.bytes_per_slot}

    def _counters(self) -> dict[str, Any]:
        """Requests now, and tokens and steps since start (get_server_info and get_stats)."""
        s = self.scheduler
        return {
            "num_running_reqs": len(s.running),
            "num_queued_reqs": len(s.waiting) + self.loop.num_pending_commands,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_forward_steps": s.num_forward_steps,
            # prompt tokens this worker's forwards computed (a PD decode worker: none)
            "num_computed_prompt_tokens": s.num_computed_prompt_tokens,
            # loop time spent answering the dashboard (get_stats, cache_tree, ...)
            "dashboard_busy_s": self.dashboard_busy_s,
        }

    @_dashboard_call
    def cache_tree(self, max_nodes: int = 500, edge_tokens: int = 32, next_evict: int = 16,
                   known_id: int | None = None) -> dict[str, Any]:
        """A snapshot of the radix tree, as rows (radix_cache.snapshot; `expand` for dicts).

        It runs on the loop thread, for a time that grows with the nodes shown and their
        children (about 5 ms for 500 of 10,000 nodes here, 35 ms for all of them), so a fresh
        one is taken at most once per `cost / SNAPSHOT_DUTY` seconds and callers in between
        get the last one: however often the tree is asked for, the loop spends at most 1% of
        its time on it. A caller that already holds snapshot `known_id` gets
        `{"snapshot_id": known_id, "unchanged": True}` instead. The budget is one for all
        parameters (alternating them must not buy fresh walks): parameters with no snapshot
        yet while it is spent get `{"retry_after": seconds}`.
        """
        from radix_cache.snapshot import snapshot

        key = (max_nodes, edge_tokens, next_evict)
        now = time.monotonic()
        last = self._snapshots.get(key)
        if last is not None and (now - last[0] < last[1] / SNAPSHOT_DUTY
                                 or now < self._next_snapshot_at):
            tree = last[2]
            if known_id == tree["snapshot_id"]:
                return {"snapshot_id": known_id, "unchanged": True}
            return {**tree, "lora_namespaces": self._lora_namespaces()}
        if now < self._next_snapshot_at:
            return {"retry_after": self._next_snapshot_at - now}
        t0 = time.perf_counter()
        tree = snapshot(self.scheduler.cache.tree, max_nodes=max_nodes,
                        edge_tokens=edge_tokens, next_evict=next_evict,
                        holders=self._holders(), rows=True)
        cost = time.perf_counter() - t0
        self._snapshot_ids += 1
        tree.update(snapshot_id=self._snapshot_ids, snapshot_ms=round(cost * 1000, 3),
                    taken_at=time.time())
        self._next_snapshot_at = now + cost / SNAPSHOT_DUTY
        self._snapshots[key] = (now, cost, tree)
        while len(self._snapshots) > 8:  # kept for the parameters asked last
            del self._snapshots[next(iter(self._snapshots))]
        return {**tree, "lora_namespaces": self._lora_namespaces()}

    @_dashboard_call
    def cache_node(self, node_id: int) -> dict[str, Any] | None:
        from radix_cache.snapshot import node_detail

        node = node_detail(self.scheduler.cache.tree, node_id, self._holders())
        return node if node is None else {**node, "lora_namespaces": self._lora_namespaces()}

    def _lora_namespaces(self) -> dict[str, str]:
        """{namespace: adapter name} of the adapters' branches (JSON keys are strings)."""
        return {str(ns): name for ns, name in self.scheduler.lora_namespaces.items()}

    @_dashboard_call
    def cache_match(self, input_ids: list[int]) -> dict[str, Any]:
        """What the tree holds of `input_ids` (no hit counted), and the prefix the scheduler
        would reuse for it as a new request (at least one token must still run)."""
        from radix_cache.snapshot import match_view

        tree = self.scheduler.cache.tree
        # the operator asks across tenants: the shared namespace and every tenant's whose
        # path starts with this first token; the longest match answers
        keys = [input_ids]
        if input_ids:
            keys += [[k, *input_ids[1:]] for k in tree.root.children
                     if k < 0 and untag_token(k) == input_ids[0]]
        view = max((match_view(tree, key) for key in keys),
                   key=lambda v: v["matched_tokens"])
        view["reusable_tokens"] = min(view["matched_tokens"], max(len(input_ids) - 1, 0))
        return view

    def _holders(self) -> list[tuple[str, Any]]:
        return [(r.rid, r.last_node) for r in self.scheduler.running if r.last_node is not None]


def build_grammar_backend(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                          name: str, memory_limit_mb: int = 0) -> Any:
    """The grammar backend; with `memory_limit_mb` > 0 every new spec is first compiled in a
    worker process capped at that much memory and killed at the timeout (grammar_isolation)."""
    from constrained import GrammarBackend, TokenizerInfo

    info = TokenizerInfo(vocab=tokenizer.token_bytes_list(), vocab_size=vocab_size,
                         eos_token_ids=eos_token_ids,
                         special_token_ids=tokenizer.special_token_ids)
    if memory_limit_mb > 0:
        from sglang_like.engine_core.grammar_isolation import IsolatedGrammarBackend

        return IsolatedGrammarBackend(info, name, memory_limit_mb)
    return GrammarBackend(info, name)
