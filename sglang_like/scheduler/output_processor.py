"""OutputProcessor: a sampled token -> grammar, finish checks, detokenized text, jump-forward."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from sglang_like.detokenizer import IncrementalDetokenizer
from sglang_like.req import FinishReason, Req, internal_error_message
from sglang_like.utils.fault_injection import FaultInjector

if TYPE_CHECKING:
    from sglang_like.scheduler.cache_manager import KVCacheManager
    from sglang_like.scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

# Jump-forward re-encodes at most this many trailing tokens together with the forced text.
_JUMP_BACK_TOKENS = 2


class OutputProcessor:
    """Turns each sampled token into request state: only the scheduler thread calls it."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], cache: KVCacheManager,
                 config: SchedulerConfig, faults: FaultInjector | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.cache = cache
        self.config = config
        self.faults = faults or FaultInjector()

    # ---- grammar masks -------------------------------------------------------------------
    def grammar_bitmask(self, reqs: list[Req]) -> torch.Tensor | None:
        """Packed int32 [B, ceil(V/32)] allowed-token bitmask; None if no request has a grammar."""
        if all(r.grammar is None for r in reqs):
            return None
        from constrained import allocate_token_bitmask

        bitmask = allocate_token_bitmask(len(reqs), self.config.vocab_size)
        for i, r in enumerate(reqs):
            if r.grammar is None:
                continue
            try:
                self.faults.maybe_fail("grammar")
                r.grammar.fill_next_token_bitmask(bitmask, i)
            except Exception as exc:  # noqa: BLE001 - a grammar's bug ends its request only
                logger.exception("grammar of %s failed", r.rid)
                bitmask[i] = -1  # sample anything: the request is over, its token is dropped
                r.finish(FinishReason("abort", message=internal_error_message(exc)))
        return bitmask

    # ---- one token -----------------------------------------------------------------------
    def append_token(self, req: Req, token_id: int, logprob: float | None,
                     top: list[tuple[float, int]] | None) -> None:
        if not req.output_ids:
            req.first_token_time = time.perf_counter()
        req.output_ids.append(token_id)
        if req.return_logprob:
            req.logprobs.output_token.append((logprob, token_id))
            req.logprobs.output_top.append(top or [])
        if req.grammar is not None and not req.grammar.accept_token(token_id):
            req.finish(FinishReason("abort", message=f"grammar rejected token {token_id}"))
            return
        self._check_token_finish(req, token_id)
        self._detokenize(req, [token_id])
        if req.is_finished or req.grammar is None:
            return
        if self.config.enable_jump_forward and not req.return_logprob:
            # a later jump-forward may re-tokenize this many trailing ids: a stream sends
            # them only once they are final
            req.num_unstable_ids = _JUMP_BACK_TOKENS
        if req.grammar.is_terminated():
            req.finish(FinishReason("stop", matched=token_id))
        elif self.config.enable_jump_forward and not req.return_logprob:
            self._jump_forward(req)

    def _check_token_finish(self, req: Req, token_id: int) -> None:
        sp = req.sampling_params
        num_out = len(req.output_ids)
        if num_out > sp.min_new_tokens or num_out == sp.max_new_tokens:
            if token_id in self.eos_token_ids and not sp.ignore_eos:
                req.finish(FinishReason("stop", matched=token_id))
                return
            if sp.stop_token_ids and token_id in sp.stop_token_ids:
                req.finish(FinishReason("stop", matched=token_id))
                return
        if num_out >= sp.max_new_tokens:
            req.finish(FinishReason("length", length=sp.max_new_tokens))
        elif req.seq_len >= self.config.context_len:
            req.finish(FinishReason("length", length=num_out))

    def _detokenize(self, req: Req, new_ids: list[int]) -> None:
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=req.sampling_params.skip_special_tokens,
                prompt_ids=req.origin_input_ids,  # context: SentencePiece's leading space
            )
        old_len = len(req.text)
        req.text += req.detokenizer.add(new_ids)
        if req.is_finished:
            req.text += req.detokenizer.flush()
        self._check_stop_strs(req, old_len)

    def _check_stop_strs(self, req: Req, old_len: int) -> None:
        """End the request at the first stop string that overlaps text past `old_len`."""
        stops = req.sampling_params.stop_strs
        if not stops or len(req.text) <= old_len:
            return
        if len(req.output_ids) <= req.sampling_params.min_new_tokens and not req.is_finished:
            return
        longest = max(len(s) for s in stops)
        window_start = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            idx = req.text.find(s, window_start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return
        idx, s = best
        req.text = req.text[: idx + len(s)] if req.sampling_params.no_stop_trim else req.text[:idx]
        req.finished_reason = None  # a stop string found this step wins over length
        req.finish(FinishReason("stop", matched=s))

    def _jump_forward(self, req: Req) -> None:
        from constrained import apply_jump_forward

        # The dropped tokens must be request-owned (not yet in the tree) and the last one
        # is never computed, so at most kv_len - cache_protected_len + 1 can go. A stream
        # holds back its last JUMP_BACK_TOKENS ids (see `unstable_ids`), so this window does
        # not depend on what was streamed: streamed and whole outputs get the same ids (the
        # second bound never binds then; it keeps sent ids safe whatever happens).
        max_back = min(_JUMP_BACK_TOKENS, req.kv_len - req.cache_protected_len + 1,
                       len(req.output_ids) - req.num_sent_ids)
        if max_back < 0:
            return
        jump = apply_jump_forward(req.grammar, req.output_ids, self.tokenizer.decode,
                                  self.tokenizer.encode, max_back)
        if jump is None:
            return
        num_kept = len(req.output_ids) - jump.num_dropped
        budget = req.sampling_params.max_new_tokens
        new_ids = jump.new_ids[: budget - num_kept]  # forced text never runs past the budget
        if len(new_ids) < len(jump.new_ids):
            req.grammar.rollback(len(jump.new_ids) - len(new_ids))
        new_kv_len = min(req.kv_len, req.prompt_len + num_kept)
        self.cache.drop_tail(req, new_kv_len)
        del req.output_ids[num_kept:]
        req.output_ids += new_ids
        if len(req.output_ids) >= budget:
            req.finish(FinishReason("length", length=budget))
        elif req.grammar.is_terminated():
            req.finish(FinishReason("stop", matched=req.output_ids[-1]))
        old_len = len(req.text)
        self._resync_text(req)  # after the finish checks, so a finished request is flushed
        self._check_stop_strs(req, old_len)  # the forced text may hold a stop string

    def _resync_text(self, req: Req) -> None:
        """After a token edit the text only grew; rebuild the detokenizer at the new ids."""
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=req.sampling_params.skip_special_tokens,
            prompt_ids=req.origin_input_ids,  # context: SentencePiece's leading space
        )
        text = req.detokenizer.add(req.output_ids)
        if req.is_finished:
            text += req.detokenizer.flush()
        assert text.startswith(req.text[: req.num_sent_chars]), "jump-forward changed sent text"
        req.text = text
