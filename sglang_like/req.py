"""Req: one generation request's state as the scheduler sees it, and how it finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_like.sampling_params import SamplingParams

if TYPE_CHECKING:  # the HTTP process builds Reqs' messages without torch
    import torch


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: type is "stop" (EOS, stop token or stop string), "length" or "abort"."""

    type: str
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None  # an abort for bad input: 400 (SGLang's field)

    def to_dict(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.status_code is not None:
            return {"type": "abort", "message": self.message, "status_code": self.status_code}
        return {"type": "abort", "message": self.message}


def internal_error_message(exc: BaseException) -> str:
    """The abort message of a request ended by a fault inside the runtime."""
    return f"internal error: {type(exc).__name__}: {exc}"


@dataclass
class Logprobs:
    """Logprob records of one request: entries are (logprob | None, token_id)."""

    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass
class SpecState:
    """Per-request speculation state (lives on the Req). Here, not in `speculative`, because
    every Req carries one and the speculative package sits above Req: the controller
    (`speculative.controller`) and the drafters write it, the scheduler reads its counters."""

    verify_ct: int = 0  # decode forwards of this request (plain or tree): SGLang's spec_verify_ct
    accepted_drafts: int = 0  # drafted tokens the target kept
    backoff_until: int = 0  # the controller's step count before which it does not draft
    num_failed_tries: int = 0  # pauses in a row since a tree was last verified
    empty_steps: int = 0  # steps in a row whose drafts were all turned down (confident drafter)
    copying: bool = False  # its last verified cheap tree had a draft accepted (_evidence_key)
    joined: bool = False  # the controller has seen it (a new one starts in the batch's pause)
    ngram: object | None = None  # NgramIndex
    eagle: object | None = None  # EAGLE drafter state: next-step candidates, feature
    eagle_pending: object | None = None  # (first position, target features) not yet drafted


class Req:
    """A request inside the scheduler. Only the scheduler thread mutates it.

    KV regions of the request's req_to_token row (positions of fill_ids):

        [0, cache_protected_len)        slots owned by the radix tree, locked via last_node
        [cache_protected_len, kv_len)   slots the request allocated itself
        [kv_len, len(fill_ids))         tokens whose K/V are not computed yet

    The last token of fill_ids is always uncomputed while the request runs: it is the next
    forward's input (the last prompt token, or the token sampled last step).
    """

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        # KV state
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.cache_protected_len = 0
        self.last_node: Any = None
        self.num_cached_tokens = 0  # prompt tokens served from the cache at first prefill
        self.num_retractions = 0
        # its scheduling priority (priority scheduling only; scheduler.policy says which way)
        self.priority = 0
        # Decoding state
        self.grammar: Any = None  # constrained.Grammar, or None
        self.invalid_message: str | None = None  # a grammar that failed to compile
        self.generator: torch.Generator | None = None
        self.spec = SpecState()  # speculative decoding: counters and drafter state
        # prefill/decode disaggregation: (bootstrap_host, bootstrap_port, bootstrap_room) when
        # sglang-router's PD mode sent it, and the transfer's state on this worker
        self.bootstrap: tuple[str, int, int] | None = None
        self.pd: Any = None
        # the tenant's part of the radix tree (scheduler.cache_manager.cache_namespace of its
        # cache_salt); None: the shared part
        self.cache_namespace: int | None = None
        # the LoRA adapter it runs on (a lora.registry.LoadedAdapter, held from admission to
        # the end even if the adapter is unloaded meanwhile); None: the base model
        self.lora: Any = None
        self.lora_name: str | None = None  # the adapter it asked for (resolved at admission)
        # an embedding request ("last" / "mean" pooling of the final hidden states; its prompt
        # is prefilled, nothing generated): the running sum and the normalized result
        self.pooling: str | None = None
        self.embedding_sum: Any = None
        self.embedding: Any = None
        # its prompt's images (engine_core.messages.ImageItem; their positions hold pad ids
        # past the vocabulary, which the model runner swaps for their embeddings); None: text
        self.images: list[Any] | None = None
        self.finished_reason: FinishReason | None = None
        self.logprobs = Logprobs()
        # next prompt position whose logprob is still to be collected
        self.input_logprob_next_pos = max(logprob_start_len, 1)
        self.detokenizer: Any = None
        self.text = ""  # detokenized output, stop strings not yet trimmed
        self.num_sent_ids = 0
        self.num_unstable_ids = 0  # trailing output ids jump-forward may still rewrite
        self.num_sent_chars = 0
        self.num_sent_output_logprobs = 0
        # Timing
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    # ---- derived --------------------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (the decode path asks every step)."""
        num_prompt = len(self.origin_input_ids)
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.origin_input_ids[start:end] + self.output_ids[: max(end - num_prompt, 0)]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def is_finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_prefill_only(self) -> bool:
        return self.sampling_params.max_new_tokens == 0

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def num_uncomputed(self) -> int:
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        """All but the last token computed, so the next forward is a single-token decode."""
        return self.output_ids != [] and self.num_uncomputed == 1

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.finish_time = time.perf_counter()
            if self.lora is not None:
                self.lora.in_flight -= 1  # the registry may evict it once idle

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
            f"kv={self.kv_len}, protected={self.cache_protected_len})"
        )
