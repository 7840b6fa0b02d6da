"""The engine's edges: turning user inputs into token lists, and requests into output dicts."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

from sglang_like.req import Req


class RequestHandle:
    """Where a request's outputs arrive (from the loop thread, or from the thread that receives
    the engine process's messages); read by a sync or an asyncio caller."""

    def __init__(self, rid: str, stream: bool, loop: asyncio.AbstractEventLoop | None) -> None:
        self.rid = rid
        self.stream = stream
        self.loop = loop
        # set: logprob entries get their token's text here (the loop sends them without it)
        self.logprob_tokenizer: Any = None
        self.done = False
        self._sync_q: queue.Queue[dict] | None = None if loop else queue.Queue()
        self._async_q: asyncio.Queue[dict] | None = asyncio.Queue() if loop else None

    def put(self, out: dict) -> None:
        """Called by one thread only (the loop, or the engine client's receiver)."""
        if self.prepare(out):
            return
        try:
            self.loop.call_soon_threadsafe(self._async_q.put_nowait, out)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def prepare(self, out: dict) -> bool:
        """The part of `put` done on the delivering thread; True if `out` was delivered (a
        sync caller), else the caller's event loop must still run `deliver_in_loop(out)`."""
        if out["meta_info"]["finish_reason"] is not None:
            self.done = True
        if self.logprob_tokenizer is not None:
            add_logprob_text(out["meta_info"], self.logprob_tokenizer)
        if self._sync_q is not None:
            self._sync_q.put(out)
            return True
        return False

    def deliver_in_loop(self, out: dict) -> None:
        """Runs on the caller's event loop (see `prepare`)."""
        self._async_q.put_nowait(out)

    def next_sync(self) -> dict:
        return self._sync_q.get()

    async def next_async(self) -> dict:
        return await self._async_q.get()

    def wait_final(self) -> dict:
        while True:
            out = self._sync_q.get()
            if out["meta_info"]["finish_reason"] is not None:
                return out

    async def async_final(self) -> dict:
        while True:
            out = await self._async_q.get()
            if out["meta_info"]["finish_reason"] is not None:
                return out


def prepare_inputs(
    tokenizer: Any, prompt: Any, input_ids: Any, sampling_params: Any, rid: Any
) -> tuple[list[tuple[list[int], dict | None, str | None]], bool]:
    """Normalize (prompt | input_ids, sampling_params, rid) into per-item triples.

    Returns ([(token_ids, sampling_params_dict, rid), ...], is_batch). ValueError on bad shapes.
    """
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of a text prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            prompts, is_batch = [prompt], False
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts, is_batch = prompt, True
        else:
            raise ValueError("the prompt must be a string or a non-empty list of strings")
        id_lists = [encode_prompt(tokenizer, p) if p else [] for p in prompts]
    else:
        if isinstance(input_ids, list) and input_ids and all(
            isinstance(x, list) for x in input_ids
        ):
            id_lists, is_batch = input_ids, True
        elif isinstance(input_ids, list):
            id_lists, is_batch = [input_ids], False
        else:
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
    n = len(id_lists)
    if isinstance(sampling_params, list):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
        sps = sampling_params
    else:
        sps = [sampling_params] * n
    if isinstance(rid, list):
        if len(rid) != n:
            raise ValueError(f"{len(rid)} rids for {n} prompts")
        rids = rid
    elif rid is not None and n > 1:
        rids = [f"{rid}-{i}" for i in range(n)]
    else:
        rids = [rid] * n
    for r in rids:
        if r is not None and not isinstance(r, str):
            raise ValueError("rid must be a string")
    return list(zip(id_lists, sps, rids, strict=True)), is_batch


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Tokenize a raw prompt as HF and SGLang do: with the BOS the tokenizer adds, if any, but
    not twice when the text (a rendered chat template) already starts with it."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _lp_entries(entries: list[tuple[float | None, int]], tokenizer: Any,
                with_text: bool) -> list[list]:
    return [[lp, tok, tokenizer.decode([tok]) if with_text else None] for lp, tok in entries]


def _top_entries(rows: list, tokenizer: Any, with_text: bool) -> list:
    return [None if row is None else _lp_entries(row, tokenizer, with_text) for row in rows]


_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


def add_logprob_text(meta: dict[str, Any], tokenizer: Any) -> None:
    """Fill the text of each [logprob, token_id, text] entry (built without it)."""
    for key in _LOGPROB_KEYS:
        for entry in meta.get(key) or ():
            entry[2] = tokenizer.decode([entry[1]])
    for key in _TOP_KEYS:
        for row in meta.get(key) or ():
            for entry in row or ():
                entry[2] = tokenizer.decode([entry[1]])


def build_output(req: Req, tokenizer: Any, text_in_logprobs: bool, incremental: bool) -> dict:
    """The result dict of a request: whole, or (incremental) only what is new since last time."""
    finished = req.is_finished
    emit_upto = len(req.text)
    if not finished:
        emit_upto -= _stop_holdback(req.text, req.sampling_params.stop_strs)
    start_chars = req.num_sent_chars if incremental else 0
    start_ids = req.num_sent_ids if incremental else 0
    start_lp = req.num_sent_output_logprobs if incremental else 0
    text = req.text[start_chars:emit_upto] if emit_upto > start_chars else ""
    ids_upto = len(req.output_ids)
    if incremental and not finished:  # ids a jump-forward may still rewrite wait
        ids_upto = max(ids_upto - req.num_unstable_ids, start_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.num_cached_tokens,
        # decode forwards (verify passes) of this request, as SGLang reports it; with
        # speculation on, acceptance length = completion_tokens / spec_verify_ct
        "spec_verify_ct": req.spec.verify_ct,
        "finish_reason": req.finished_reason.to_dict() if finished else None,
        "e2e_latency": time.perf_counter() - req.arrival_time,
        "queue_time": ((req.first_scheduled_time or time.perf_counter()) - req.arrival_time),
        # arrival -> first output token (None before it); with queue_time and e2e_latency it
        # places a request's queue, prefill and decode phases (server/tracing.py)
        "first_token_latency": (None if req.first_token_time is None
                                else req.first_token_time - req.arrival_time),
    }
    if req.return_logprob:
        lp = req.logprobs
        meta["output_token_logprobs"] = _lp_entries(lp.output_token[start_lp:], tokenizer,
                                                    text_in_logprobs)
        meta["output_top_logprobs"] = _top_entries(lp.output_top[start_lp:], tokenizer,
                                                   text_in_logprobs)
        meta["output_token_logprobs_length"] = len(lp.output_token)
        if not incremental or req.num_sent_output_logprobs == 0 and req.num_sent_ids == 0:
            meta["input_token_logprobs"] = _lp_entries(lp.input_token, tokenizer,
                                                       text_in_logprobs)
            meta["input_top_logprobs"] = _top_entries(lp.input_top, tokenizer, text_in_logprobs)
    out = {"text": text, "output_ids": req.output_ids[start_ids:ids_upto], "meta_info": meta}
    if req.embedding is not None:
        out["embedding"] = req.embedding.tolist()
    if incremental:
        req.num_sent_chars = max(req.num_sent_chars, emit_upto)
        req.num_sent_ids = ids_upto
        req.num_sent_output_logprobs = len(req.logprobs.output_token)
    return out
