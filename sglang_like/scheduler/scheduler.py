"""Scheduler: one `step()` = pick a mixed batch, run it, sample, finish requests."""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
from typing import Any, Protocol

import torch

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.namespace import adapter_namespace
from sglang_like.layers.device_sampler import DeviceSampler
from sglang_like.layers.sampler import SampleOutput, Sampler, select_rows
from sglang_like.mem_pool import ReqToTokenPool
from sglang_like.req import FinishReason, Req, internal_error_message
from sglang_like.schedule_batch import ScheduleBatch
from sglang_like.scheduler.cache_manager import KVCacheManager
from sglang_like.scheduler.config import SchedulerConfig
from sglang_like.scheduler.output_processor import OutputProcessor
from sglang_like.scheduler.plugins import DisaggContext, DisaggHooks, DraftContext, Drafter
from sglang_like.scheduler.policy import (
    IN_BATCH_SHARE_THRESHOLD,
    common_prefix_len,
    order_waiting,
    priority_rank,
)
from sglang_like.scheduler.spec_propose import propose_trees
from sglang_like.scheduler.spec_verify import TreeWalk, VerifyContext, accept_trees, takes_argmax
from sglang_like.speculative.controller import SpecController
from sglang_like.speculative.tree import DraftTree
from sglang_like.utils.fault_injection import FaultInjector

logger = logging.getLogger(__name__)

# Slots kept back per running request when admitting a new prefill, so that decoding does
# not immediately run out and retract (requests still retract when this guess is short).
_DECODE_RESERVE_PER_REQ = 8


class ModelRunnerLike(Protocol):
    """What the scheduler needs of a model runner (the real one, or a scripted fake in tests)."""

    req_to_token_pool: ReqToTokenPool

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] float32 on the host. With
        `config.device_sampling` the scheduler calls `forward(batch, to_host=False)`, which
        may leave them on the model's device."""


class Scheduler:
    """Continuous batching over a radix-cached KV pool. Single-threaded: the engine's loop
    thread calls add_request / abort / step; nothing else touches a Req while it is here."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunnerLike, tokenizer: Any,
                 eos_token_ids: frozenset[int], drafter: Drafter | None = None) -> None:
        """`drafter`: speculative decoding (optional), see `plugins.Drafter`."""
        self.config = config
        self.runner = runner
        allocator = KVSlotAllocator(config.pool_size)
        tree = RadixCache(allocator, config.eviction_policy, disable=config.disable_radix_cache)
        self.cache = KVCacheManager(allocator, tree, runner.req_to_token_pool)
        self.sampler = Sampler(eos_token_ids, config.vocab_size, tokenizer)
        self.device_sampler = (DeviceSampler(eos_token_ids, config.vocab_size)
                               if config.device_sampling else None)
        self.faults = FaultInjector.from_env()
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, self.cache, config,
                                       self.faults)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._rng = random.Random(config.random_seed)
        self._finished_outside_step: list[Req] = []
        self.drafter = drafter
        # prefill/decode disaggregation (sglang_like.disaggregation, set by the engine core):
        # None on a regular worker
        self.disagg: DisaggHooks | None = None
        # the loaded LoRA adapters (a lora.LoraRegistry, set by the engine core when LoRA is
        # enabled): a request naming one holds it from here to its end
        self.loras: Any = None
        # the radix namespaces requests on adapters took, with the adapter's name (the
        # dashboard labels a branch with it); the latest few thousand
        self.lora_namespaces: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._drafting_s, self._num_decoders = 0.0, 0  # this step's drafting (the controller's)
        self.spec_accept_lengths: collections.Counter[int] = collections.Counter()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start the statistics and the speculation controller's measurements afresh (after
        the start-up warmup, whose requests are no one's and whose steps paid for
        compiling: they would price every later step)."""
        # rows cost a share of a step on CPU (its floor, measured there), next to nothing on CUDA
        on_cuda = getattr(getattr(self.runner, "device", None), "type", None) == "cuda"
        self.spec_controller = SpecController(enabled=self.config.speculative_auto_disable,
                                              **({"row_share": None} if on_cuda else {}))
        self.spec_accept_lengths.clear()
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_forward_steps = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens this worker's forwards ran

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a validated request. One that can never fit ends at once with an abort."""
        sp = req.sampling_params
        if not sp.is_greedy:
            seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
            req.generator = torch.Generator().manual_seed(seed)
        if req.lora_name is not None and not self._take_adapter(req):
            return
        if req.seq_len + 1 > self.config.pool_size:
            self.finish_outside_step(req, FinishReason("abort", message=(
                f"the prompt has {req.seq_len} tokens but the KV pool holds only "
                f"{self.config.pool_size}; raise max_total_tokens")))
            return
        if req.bootstrap is not None and self.disagg is not None:
            self.disagg.add(req)  # a PD request: it meets its other half first
            if req.is_finished:
                self._finished_outside_step.append(req)
            return
        if self._queue_is_full() and not self._make_room_in_queue(req):
            return
        self.waiting.append(req)

    def _take_adapter(self, req: Req) -> bool:
        """Give `req` the adapter it names, in a radix namespace of that load of it (KV is
        never shared across adapters, nor with a later load of the same name); False (and
        the request ended, 400) when no adapter of that name is loaded now."""
        entry = self.loras.acquire(req.lora_name) if self.loras is not None else None
        if entry is None:
            self.finish_outside_step(req, FinishReason(
                "abort", message=f"LoRA adapter {req.lora_name!r} is not loaded", status_code=400))
            return False
        req.lora = entry
        req.cache_namespace = adapter_namespace(req.cache_namespace, entry.uid)
        self.lora_namespaces[req.cache_namespace] = entry.name
        self.lora_namespaces.move_to_end(req.cache_namespace)
        if len(self.lora_namespaces) > 4096:
            self.lora_namespaces.popitem(last=False)
        return True

    def abort(self, rid: str) -> bool:
        """End a queued or running request now and free what it holds."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    req.finish(FinishReason("abort", message="aborted"))
                    queue.remove(req)
                    self.cache.release(req)
                    self._finished_outside_step.append(req)
                    return True
        if self.disagg is not None:
            req = self.disagg.abort(rid, self._disagg_context())
            if req is not None:
                self._finished_outside_step.append(req)
                return True
        return False

    def abort_all(self, message: str) -> list[Req]:
        """End every queued, running and in-flight (PD) request now; returns them."""
        reqs = self.waiting + self.running
        for req in reqs:
            req.finish(FinishReason("abort", message=message))
            self.cache.release(req)
        self.waiting, self.running = [], []
        if self.disagg is not None:
            reqs += self.disagg.abort_all(message, self._disagg_context())
        return reqs

    def finish_outside_step(self, req: Req, reason: FinishReason) -> None:
        """End a request the scheduler does not hold (it never joined: bad input, a grammar
        that failed or is late, an abort while it compiled) and return it with the next
        step's output, as if it had ended there."""
        req.finish(reason)
        self._finished_outside_step.append(req)

    def take_finished_outside_step(self) -> list[Req]:
        """The requests ended outside a step that no step has returned yet: the caller
        answers them now (the loop, shutting down)."""
        ended, self._finished_outside_step = self._finished_outside_step, []
        return ended

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_outside_step
                    or (self.disagg is not None and self.disagg.has_news))

    def flush_cache(self) -> bool:
        """Empty the radix tree; refused (False) while requests are queued or running."""
        if self.waiting or self.running or (self.disagg is not None
                                            and self.disagg.num_inflight):
            return False
        self.cache.tree.reset()
        flush = getattr(self.drafter, "flush", None)
        if flush is not None:
            flush()  # NGRAM's text of finished requests goes with the cache
        return True

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; return the requests with new output or that finished.

        Never raises for a fault inside the step (a forward that fails, a bug in sampling or
        a grammar): the requests of the failed batch end with `internal error: ...`, every
        slot they held comes back, and the others go on.
        """
        touched = self._finished_outside_step
        self._finished_outside_step = []
        batch = ScheduleBatch()
        try:
            if self.disagg is not None:
                self.disagg.poll(self._disagg_context(), touched)
            start = time.perf_counter()  # the step's cost includes drafting (in scheduling)
            self._preempt_for_priority()
            self._schedule_running(batch, touched)
            self._schedule_waiting(batch, touched)
            if batch.batch_size:
                self._run(batch, touched, start)
        except Exception as exc:  # noqa: BLE001 - ends the batch's requests, never the loop
            logger.exception("scheduler step failed; ending the requests of its batch")
            self._recover(batch, touched, exc)
        if self.config.check_accounting:
            held = self.disagg.held_slots() if self.disagg is not None else []
            self.cache.check_accounting(self.running, pending_slots=len(held))
        # once each (a PD request can arrive and decode in one step): a stream gets one chunk
        return list(dict.fromkeys(touched)) if self.disagg is not None else touched

    def _run(self, batch: ScheduleBatch, touched: list[Req], start: float) -> None:
        self.faults.maybe_fail("forward")
        disagg = self.disagg
        if disagg is not None:
            # a prefill worker streams each layer's KV to the decode worker
            batch.on_layer = disagg.before_forward(batch)
        logits = greedy = None
        try:
            if self._argmax_only(batch):
                greedy = self.runner.forward_greedy(batch)
            else:
                logits = self._forward(batch)
        finally:
            if disagg is not None:
                disagg.after_forward()  # its slots are not freed with a write in flight
        self.num_forward_steps += 1
        walks: list[TreeWalk] = []
        self._process(batch, logits, walks, touched, greedy)
        if disagg is not None:
            disagg.after_process(batch)
        after = getattr(self.drafter, "after_forward", None)
        drafting = self._drafting_s
        if after is not None:
            t0 = time.perf_counter()
            after(batch, {id(w.req): w.committed for w in walks}, self._draft_context())
            drafting += time.perf_counter() - t0
        ctl = self.spec_controller
        if ctl.drafted_step == ctl.step:
            ctl.record_drafting(self._num_decoders, drafting)
        # the speculation controller prices rows by the step without its drafting (the
        # verify rows and the walks stay in): drafting is priced on its own, per batch size
        ctl.record_forward(batch.num_tokens, time.perf_counter() - start - drafting)

    def _recover(self, batch: ScheduleBatch, touched: list[Req], exc: Exception) -> None:
        """After a fault: end the batch's requests (all of them if the fault came before a
        batch was formed, so a fault that repeats cannot spin), then take back every slot
        that no one owns any more (allocated for the batch, not yet in a request's row)."""
        message = internal_error_message(exc)
        victims = list(dict.fromkeys(batch.reqs)) or self.waiting + self.running
        seen = {id(r) for r in touched}
        for req in victims:
            req.finish(FinishReason("abort", message=message))
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            self.cache.release(req)
            if id(req) not in seen:
                touched.append(req)
        for req in touched + self.waiting:  # only running requests may hold a row
            if req.req_pool_idx is not None and req not in self.running:
                self.cache.release(req)
        held = self.disagg.held_reqs() if self.disagg is not None else []
        num = self.cache.reclaim_orphans(
            self.running, held, self.disagg.held_slots() if self.disagg is not None else ())
        if num:
            logger.warning("took back %d KV slots the failed step had allocated", num)
        if self.disagg is not None:  # a PD prefill worker tells the decode side now
            self.disagg.report_ended()

    def _schedule_running(self, batch: ScheduleBatch, touched: list[Req]) -> None:
        decoders = [r for r in self.running if r.num_uncomputed == 1]
        while len(decoders) > self.cache.num_available_slots:
            if not self._retract_one(batch, touched):
                break
            decoders = [r for r in self.running if r.num_uncomputed == 1]
        t0 = time.perf_counter()
        trees = self._propose_trees(decoders)
        self._drafting_s = time.perf_counter() - t0
        self._num_decoders = len(decoders)
        budget = self.config.prefill_budget
        # decodes first: the next prefill chunks are sized by what they leave
        for req in sorted(self.running, key=lambda r: r.num_uncomputed != 1):
            if req not in self.running:
                continue  # retracted below to make room for an earlier one
            tree = trees.get(id(req))
            if tree is not None:
                slots = self.cache.alloc_slots(tree.num_nodes)
                if slots is not None:
                    self.cache.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)
                    batch.add_tree(req, tree, slots)
                    continue
            n = self._next_extend_len(req, budget)
            if n is None:
                continue
            slots = self.cache.alloc_slots(n) if n else None
            while slots is None:
                # Nothing left for even one token: part-prefilled requests may each hold
                # what another needs. Retract the latest arrival not in this batch.
                if not self._retract_one(batch, touched) or req not in self.running:
                    break
                n = self._next_extend_len(req, budget)
                slots = self.cache.alloc_slots(n) if n else None
            if slots is None:
                continue
            if n > 1:
                budget -= n
            self._add_to_batch(batch, req, n, slots)

    def _next_extend_len(self, req: Req, budget: int) -> int | None:
        """Tokens to run for a running request this step: 1 for a decode; for the rest of a
        prefill the next chunk, within the token budget and the slots to be had (0: none
        left, retract to go on). None: it waits for a later step (budget spent)."""
        if req.num_uncomputed == 1:
            return 1
        n = min(req.num_uncomputed, budget)
        if n <= 0:
            return None
        if not self.config.is_chunking:
            return n if n == req.num_uncomputed else None
        return whole_images(req, req.kv_len, min(n, self.cache.num_available_slots))

    def _propose_trees(self, decoders: list[Req]) -> dict[int, DraftTree]:
        """This step's draft trees (by id of the Req), {} where the pool cannot take them."""
        if self.drafter is None:
            return {}
        trees = propose_trees(self.drafter, self._draft_context(), decoders,
                              self.config.context_len)
        extra = sum(t.num_nodes - 1 for t in trees.values())
        return trees if len(decoders) + extra <= self.cache.num_available_slots else {}

    def _schedule_waiting(self, batch: ScheduleBatch, touched: list[Req]) -> None:
        budget = self.config.prefill_budget - sum(n for n in batch.extend_lens if n > 1)
        if (not self.waiting or budget <= 0
                or len(self.running) >= self.config.max_running_requests
                or self.cache.req_to_token_pool.num_free_rows == 0):
            return  # nothing can be admitted: skip ordering (a tree walk per waiting request)
        reserve = _DECODE_RESERVE_PER_REQ * len(self.running)
        picked: list[Req] = []
        # One side-effect-free peek per waiting request per step: it orders the queue and
        # sizes the admission; only an admitted request's match counts as a hit.
        peeks: dict[int, tuple[int, int]] = {}

        def peek(r: Req) -> tuple[int, int]:
            if id(r) not in peeks:
                peeks[id(r)] = self.cache.peek(r.fill_ids[: self._max_prefix_len(r)],
                                               r.cache_namespace)
            return peeks[id(r)]

        lpm = self.config.schedule_policy == "lpm" and len(self.waiting) > 1
        ordered = order_waiting(self.waiting, "lpm" if lpm else "fcfs", lambda r: peek(r)[0],
                                self._rank if self.config.enable_priority_scheduling else None)
        adapters = {r.lora.uid for r in self.running if r.lora is not None}
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self.cache.req_to_token_pool.num_free_rows == 0:
                break
            if (req.lora is not None and req.lora.uid not in adapters
                    and len(adapters) >= self.config.max_loras_per_batch):
                continue  # one adapter too many for this batch: it waits for a later one
            cap = self._max_prefix_len(req)
            match_len, match_unlocked = peek(req)
            if any(common_prefix_len(req.fill_ids, p.fill_ids) - match_len
                   >= IN_BATCH_SHARE_THRESHOLD for p in picked):
                continue  # the picked request's prefix is in the tree by next step
            extend = req.seq_len - match_len
            n = min(extend, budget) if self.config.is_chunking else extend
            if n > budget and batch.batch_size:
                break
            # the whole rest of the prompt must fit (not just its first chunk), besides
            # the matched prefix, which locking takes out of the evictable slots
            if extend + reserve > self.cache.num_available_slots - match_unlocked:
                break
            self.cache.match_and_lock(req, cap)
            n = whole_images(req, req.kv_len, min(req.seq_len - req.kv_len, n))
            slots = self.cache.alloc_slots(n)
            if slots is None:  # the locked match changed what was evictable
                self.cache.release(req)
                break
            if req.first_scheduled_time is None:
                self.record_admission(req)
            self.waiting.remove(req)
            self.running.append(req)
            picked.append(req)
            if req.lora is not None:
                adapters.add(req.lora.uid)
            self._add_to_batch(batch, req, n, slots)
            budget -= n
            reserve += _DECODE_RESERVE_PER_REQ

    def _add_to_batch(self, batch: ScheduleBatch, req: Req, n: int, slots: list[int]) -> None:
        self.num_computed_prompt_tokens += max(min(req.kv_len + n, req.prompt_len) - req.kv_len,
                                               0)
        self.cache.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)
        batch.add(req, n, slots)

    def _max_prefix_len(self, req: Req) -> int:
        cap = req.seq_len - 1  # at least one token must run to produce logits
        if req.wants_input_logprobs and req.input_logprob_next_pos < req.prompt_len:
            cap = min(cap, max(req.input_logprob_next_pos - 1, 0))
        if req.pooling == "mean":  # every prompt row's hidden state is read: none cached
            cap = 0
        return cap

    def _retract_one(self, batch: ScheduleBatch, touched: list[Req]) -> bool:
        """Make room: send the most recently arrived running request that is not in this
        batch (under priority scheduling: the least urgent, then the latest) back to the
        queue (its output so far is kept and recomputed later). When it is the only one
        running, nothing else holds what it lacks: the pool cannot hold it, it ends. False
        when neither is possible (all running requests are in the batch)."""
        idle = [r for r in self.running if r not in batch.reqs]
        if not idle:
            return False
        if len(self.running) == 1:
            req = self.running[0]
            self._end(req, FinishReason("abort", message=(
                f"the KV pool ({self.config.pool_size} slots) is too small for this "
                f"request's {req.seq_len} tokens")), touched)
            return True
        if self.config.enable_priority_scheduling:
            self._retract(max(idle, key=lambda r: (self._rank(r), r.arrival_time)))
        else:
            self._retract(max(idle, key=lambda r: r.arrival_time))
        return True

    def _retract(self, victim: Req) -> None:
        victim.embedding_sum = None  # a mean pooling starts over with the prompt
        self.running.remove(victim)
        self.cache.release(victim)
        victim.num_retractions += 1
        self.waiting.insert(0, victim)
        logger.info("retracted %s to free KV slots", victim.rid)

    # ---- priorities ------------------------------------------------------------------------
    def _rank(self, req: Req) -> int:
        return priority_rank(req, self.config.low_priority_values_first)

    def _queue_is_full(self) -> bool:
        cap = self.config.max_queued_requests
        return cap is not None and len(self.waiting) >= cap

    def _make_room_in_queue(self, req: Req) -> bool:
        """A full queue under priority scheduling drops its least urgent request that has
        not started (the latest of equals: `req` itself when it ties), ended with a 429 as
        the server's own overflow is. True: `req` may queue (another was dropped)."""
        fresh = [r for r in self.waiting if r.first_scheduled_time is None]
        victim = max([*fresh, req], key=lambda r: (self._rank(r), r.arrival_time))
        cap = self.config.max_queued_requests
        if victim is req:
            self.finish_outside_step(req, FinishReason("abort", status_code=429, message=(
                f"the waiting queue is full ({cap} requests, max_queued_requests) and this "
                f"request's priority is the lowest there; retry later")))
            return False
        self.waiting.remove(victim)
        self.finish_outside_step(victim, FinishReason("abort", status_code=429, message=(
            f"the waiting queue is full ({cap} requests, max_queued_requests): this request "
            f"was dropped from it for one of higher priority; retry later")))
        return True

    def _preempt_for_priority(self) -> None:
        """Priority scheduling: when the most urgent waiting request cannot be admitted (no
        running row free, or too few KV slots), retract the running requests it outranks by
        more than the threshold, least urgent (then latest) first, until it can. Done before
        the step's batch forms, so a victim holds nothing in it; it resumes later from the
        radix tree, which keeps what it computed. Nothing is retracted when all of them
        together could not make the room (PD workers never preempt: their KV moves)."""
        cfg = self.config
        if not (cfg.enable_priority_scheduling and self.waiting and self.running) or (
                self.disagg is not None):
            return
        head = min(self.waiting, key=lambda r: (self._rank(r), -r.num_retractions,
                                                r.arrival_time))
        limit = self._rank(head) + cfg.priority_preemption_threshold
        victims = sorted((r for r in self.running if self._rank(r) > limit),
                         key=lambda r: (self._rank(r), r.arrival_time), reverse=True)
        if not victims or self._room_lacking(head, len(self.running)) is None:
            return
        adapters = {r.lora.uid for r in self.running if r.lora is not None}
        if (head.lora is not None and head.lora.uid not in adapters
                and len(adapters) >= cfg.max_loras_per_batch):
            return  # it waits for an adapter to finish, which preempting does not hasten
        # retracting them all gives back at most their computed slots
        lacking = self._room_lacking(head, len(self.running) - len(victims))
        if lacking is not None and lacking > sum(r.kv_len for r in victims):
            return
        for victim in victims:
            self._retract(victim)
            logger.info("preempted %s (priority %d) for %s (priority %d)", victim.rid,
                        victim.priority, head.rid, head.priority)
            if self._room_lacking(head, len(self.running)) is None:
                return

    def _room_lacking(self, req: Req, num_running: int) -> int | None:
        """None when `req` could be admitted beside `num_running` of the running requests;
        else how many KV slots it lacks (0: what it lacks is a running row). The test of
        _schedule_waiting, plus this step's decode slot of each running request."""
        match_len, match_unlocked = self.cache.peek(req.fill_ids[: self._max_prefix_len(req)],
                                                    req.cache_namespace)
        need = (req.seq_len - match_len + match_unlocked
                + (_DECODE_RESERVE_PER_REQ + 1) * num_running)
        lacking = need - self.cache.num_available_slots
        if lacking > 0:
            return lacking
        no_row = num_running >= self.config.max_running_requests or (
            num_running == len(self.running)
            and self.cache.req_to_token_pool.num_free_rows == 0)
        return 0 if no_row else None

    def _forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """The batch's logits: left on the model's device for the device sampler (a verify's
        walk draws its nodes there, or copies the rows it samples on the host: spec_verify)."""
        if self.device_sampler is not None:
            return self.runner.forward(batch, to_host=False)
        return self.runner.forward(batch)

    # ---- after the forward ---------------------------------------------------------------
    def _argmax_only(self, batch: ScheduleBatch) -> bool:
        """Whether every row of a decode batch takes its plain argmax (greedy, and no logprobs,
        penalties, logit bias, grammar, or min_new_tokens holding EOS back): then the runner
        may return the tokens instead of the logits (`forward_greedy`), where it has such a
        path; not for a disaggregation role, whose steps stay as they are. A drafter's plain
        decode steps (where no draft pays: 32 rows and up on CPU) take it, EAGLE's features
        kept as in any forward."""
        if (not batch.is_decode or self.disagg is not None
                or not getattr(self.runner, "has_greedy_forward", False)):
            return False
        return all(takes_argmax(req) for req in batch.reqs)

    def _process(self, batch: ScheduleBatch, logits: torch.Tensor | None,
                 walks: list[TreeWalk], touched: list[Req],
                 greedy: list[int] | None = None) -> None:
        """A forward's results: `logits`, or for an `_argmax_only` batch the token of each
        logits row (`greedy`)."""
        for i, req in enumerate(batch.reqs):
            tree = batch.trees[i]
            if tree is not None:  # a verify: its nodes are committed as the walk accepts them
                first = sum(batch.extend_lens[:i])
                walks.append(TreeWalk(req, tree, batch.out_slots[first : first + tree.num_nodes],
                                      batch.sample_index[i]))
                continue
            req.kv_len += batch.extend_lens[i]
        if logits is not None:
            self._record_input_logprobs(batch, logits)
        to_sample: list[int] = []
        for i, req in enumerate(batch.reqs):
            if batch.trees[i] is not None:
                continue
            if batch.sample_index[i] < 0 or not req.output_ids:
                self.cache.cache_computed_prefix(req)  # a prompt (or chunk) just computed
            if batch.sample_index[i] < 0:
                continue
            if req.is_prefill_only:
                self._end(req, FinishReason("length", length=0), touched)
                continue
            to_sample.append(i)
        if to_sample or walks:
            self.faults.maybe_fail("sample")
        if to_sample:
            reqs = [batch.reqs[i] for i in to_sample]
            if greedy is not None:
                nothing: list[None] = [None] * len(reqs)
                result = SampleOutput([greedy[batch.sample_index[i]] for i in to_sample],
                                      nothing, nothing)
            else:
                result = self._sample(logits, [batch.sample_index[i] for i in to_sample], reqs)
            for j, req in enumerate(reqs):
                if req.is_finished:  # its grammar failed while the mask was built
                    self._end(req, req.finished_reason, touched)
                    continue
                self.num_generated_tokens += 1
                if self.drafter is not None and req.output_ids:
                    req.spec.verify_ct += 1  # a decode forward without a tree counts as one
                    self.spec_accept_lengths[1] += 1
                self.outputs.append_token(req, result.next_token_ids[j], result.logprobs[j],
                                          result.top_logprobs[j])
                if req.is_finished:
                    self._end(req, req.finished_reason, touched)
                else:
                    touched.append(req)
        if walks:
            accept_trees(self._verify_context(), walks, logits, touched)

    def _sample(self, logits: torch.Tensor, index: list[int], reqs: list[Req]) -> SampleOutput:
        """The tokens of `logits`' rows `index` for `reqs` (see `_sample_rows`)."""
        return self._sample_rows(select_rows(logits, index), reqs)

    def _sample_rows(self, rows: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        """The tokens of `rows` [len(reqs), V] (sampled in place): with the device sampler on,
        on their device for the requests it takes and on the host (a copy of their rows) for
        the others (DRY, XTC). Split rather than all on the host, so that a seed's draws do
        not depend on what shares its step, and a verify's walk (which splits its requests
        the same way) draws what plain decoding would."""
        bitmask = self.outputs.grammar_bitmask(reqs)
        if self.device_sampler is None:
            return self.sampler.sample(rows, reqs, bitmask)
        on_host = [i for i, r in enumerate(reqs) if not DeviceSampler.supports([r])]
        if not on_host:
            return self.device_sampler.sample(rows, reqs, bitmask)
        if len(on_host) == len(reqs):
            return self.sampler.sample(rows.cpu(), reqs, bitmask)
        on_device = sorted(set(range(len(reqs))) - set(on_host))
        drawn = self.device_sampler.sample(select_rows(rows, on_device),
                                           [reqs[i] for i in on_device],
                                           _rows_of(bitmask, on_device))
        sampled = self.sampler.sample(select_rows(rows, on_host).cpu(),
                                      [reqs[i] for i in on_host], _rows_of(bitmask, on_host))
        return _merge([(on_device, drawn), (on_host, sampled)], len(reqs))

    def _record_input_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        for req in batch.reqs:
            record = req.logprobs
            if req.wants_input_logprobs and req.logprob_start_len == 0 and not record.input_token:
                # nothing predicts the first prompt token: its entry has no logprob
                record.input_token.append((None, req.origin_input_ids[0]))
                record.input_top.append(None)
        wanted = [(req, rows) for req, rows in zip(batch.reqs, batch.input_logprob_rows,
                                                   strict=True) if rows]
        if not wanted:
            return
        # only the rows asked for are normalized, all of them in one gather, and the top
        # entries in one topk per distinct count: a handful of copies to the host a forward,
        # not a few per prompt token (on a GPU each is a sync)
        device = logits.device
        idx = torch.tensor([r[0] for _, rows in wanted for r in rows], device=device)
        targets = torch.tensor([r[1] for _, rows in wanted for r in rows], device=device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        values = lp.gather(1, targets[:, None])[:, 0].tolist()
        starts = list(itertools.accumulate((len(rows) for _, rows in wanted), initial=0))
        tops: dict[int, list] = {}  # position in `wanted` -> its rows' (values, ids)
        for k in sorted({req.top_logprobs_num for req, _ in wanted} - {0}):
            mine = [j for j, (req, _) in enumerate(wanted) if req.top_logprobs_num == k]
            sel = torch.cat([torch.arange(starts[j], starts[j + 1]) for j in mine])
            v, ids = torch.topk(lp.index_select(0, sel.to(device)), k)
            v, ids, at = v.tolist(), ids.tolist(), 0
            for j in mine:
                n = starts[j + 1] - starts[j]
                tops[j] = list(zip(v[at:at + n], ids[at:at + n], strict=True))
                at += n
        for j, (req, rows) in enumerate(wanted):
            record = req.logprobs
            for k, (_, token, _) in enumerate(rows):
                record.input_token.append((values[starts[j] + k], token))
                if j in tops:
                    tv, ti = tops[j][k]
                    record.input_top.append(list(zip(tv, ti, strict=True)))
                else:
                    record.input_top.append(None)

    def _end(self, req: Req, reason: FinishReason, touched: list[Req]) -> None:
        """End a request of this step: out of the running batch, its slots released, the
        drafter told, reported in `touched`."""
        req.finish(reason)
        if req in self.running:
            self.running.remove(req)
        self.cache.release(req)
        finished = getattr(self.drafter, "finished", None)
        if finished is not None:
            finished(req)
        touched.append(req)

    # ---- what plug-ins may do (through their contexts) -------------------------------------
    def record_admission(self, req: Req) -> None:
        """Count `req` as scheduled now (its first time): its prompt, and what of it the
        cache served."""
        req.first_scheduled_time = time.perf_counter()
        req.num_cached_tokens = req.kv_len
        self.num_prompt_tokens += req.prompt_len
        self.num_cached_prompt_tokens += req.kv_len

    def join_running(self, req: Req, token: int, logprob: float | None, top_logprobs: Any,
                     touched: list[Req]) -> None:
        """A request whose prompt's KV was computed elsewhere and is in its row now (a PD
        decode worker received it) joins the running batch as if its prefill had just run
        here, with the first token sampled there; reported in `touched`, or ended there if
        that token finishes it."""
        self.cache.cache_computed_prefix(req)  # this worker's tree keeps what it received
        self.running.append(req)
        self.outputs.append_token(req, token, logprob, top_logprobs)
        self.num_generated_tokens += 1
        if req.is_finished:
            self._end(req, req.finished_reason, touched)
        else:
            touched.append(req)

    def _draft_context(self) -> DraftContext:
        return DraftContext(self.spec_controller, self.cache.alloc_slots,
                            self.cache.allocator.free, len(self.running) + len(self.waiting))

    def _disagg_context(self) -> DisaggContext:
        # built per call: abort_all replaces the queues' lists
        return DisaggContext(self.cache, self.running, self.config.max_running_requests,
                             self.waiting.append, self.abort, self.record_admission,
                             self.join_running)

    def _verify_context(self) -> VerifyContext:
        return VerifyContext(self.cache, self._sample_rows, self.device_sampler, self.outputs,
                             self.spec_controller, self.spec_accept_lengths, self._count_token,
                             self._end)

    def _count_token(self) -> None:
        self.num_generated_tokens += 1

    # ---- introspection ---------------------------------------------------------------------
    def kv_pool_info(self) -> dict[str, int]:
        tree = self.cache.tree
        free = self.cache.allocator.num_free_slots
        return {
            "total_slots": self.config.pool_size,
            "free_slots": free,
            "cached_slots": tree.evictable_size + tree.protected_size,
            "used_slots": self.config.pool_size - free - tree.evictable_size,
            # slots 1..touched_slots have ever held K/V (the pool's pages are committed
            # lazily, so its RSS grows with this until the cache fills the pool)
            "touched_slots": self.cache.allocator.high_water,
        }

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / max(self.num_prompt_tokens, 1)


def _rows_of(bitmask: torch.Tensor | None, index: list[int]) -> torch.Tensor | None:
    return None if bitmask is None else bitmask[index]


def _merge(parts: list[tuple[list[int], SampleOutput]], num_rows: int) -> SampleOutput:
    """One output of `num_rows` rows from parts, each (the rows it covers, its output)."""
    ids, logprobs, tops = [0] * num_rows, [None] * num_rows, [None] * num_rows
    for index, out in parts:
        for j, i in enumerate(index):
            ids[i], logprobs[i], tops[i] = (out.next_token_ids[j], out.logprobs[j],
                                            out.top_logprobs[j])
    return SampleOutput(ids, logprobs, tops)


def whole_images(req: Req, start: int, n: int) -> int:
    """A prefill chunk of `n` tokens from `start`, cut so that it does not end inside an
    image whose rows attend to each other both ways (Gemma 3): it stops before such an image,
    or where it begins inside one (a cached prefix ending in it), takes the rest whole."""
    if not req.images or n <= 1:
        return n
    end = start + n
    for item in req.images:
        if item.whole:
            for s, length in item.runs:
                if s < end < s + length:
                    end = s if s > start else s + length
    return end - start
