"""Sampler: logits -> next tokens, applying penalties, masks, temperature, top-k/top-p/min-p."""

from __future__ import annotations

from typing import NamedTuple

import torch

import kernels
from sglang_like.req import Req

_NEG_INF = float("-inf")


class SampleOutput(NamedTuple):
    """Tokens chosen for each row, with their raw logprobs and top-k alternatives when asked."""

    next_token_ids: list[int]
    logprobs: list[float | None]  # raw model logprob of the chosen token (None if not asked)
    top_logprobs: list[list[tuple[float, int]] | None]


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def top_k_entries(logprobs_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs_row, min(k, logprobs_row.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


class Sampler:
    """Stateless apart from the EOS ids; per-request randomness lives in each Req's generator."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int], vocab_size: int) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size

    def sample(
        self, logits: torch.Tensor, reqs: list[Req], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """logits [B, V] float32 (modified in place); bitmask int32 [B, ceil(V/32)] of allowed
        tokens (grammar masks, packed), or None."""
        batch = len(reqs)
        want_lp = [r.return_logprob for r in reqs]
        lp = raw_logprobs(logits) if any(want_lp) else None
        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        if bitmask is not None:
            kernels.apply_token_bitmask_(logits, bitmask.to(logits.device))
        self._block_early_stop(logits, reqs, grammar_masked=bitmask is not None)
        next_ids = self._choose(logits, reqs)
        out_lp: list[float | None] = [None] * batch
        out_top: list[list[tuple[float, int]] | None] = [None] * batch
        if lp is not None:
            chosen = lp[torch.arange(batch), torch.tensor(next_ids)].tolist()
            for i, r in enumerate(reqs):
                if want_lp[i]:
                    out_lp[i] = chosen[i]
                    out_top[i] = top_k_entries(lp[i], r.top_logprobs_num)
        return SampleOutput(next_ids, out_lp, out_top)

    # ---- steps ---------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if not sp.has_penalties:
                continue
            row = logits[i]
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.fill_ids)), dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
                )
            if r.output_ids and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
                ids = torch.tensor(r.output_ids, dtype=torch.long)
                counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
                row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)

    def _apply_logit_bias(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """OpenAI's logit_bias: added to the logits after penalties, before masks and the
        choice (so it moves greedy too); the logprobs reported stay the model's own."""
        for i, r in enumerate(reqs):
            bias = r.sampling_params.token_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
                vals = torch.tensor(list(bias.values()), dtype=logits.dtype,
                                    device=logits.device)
                logits[i].index_add_(0, ids, vals)

    def _block_early_stop(self, logits: torch.Tensor, reqs: list[Req],
                          grammar_masked: bool) -> None:
        """min_new_tokens: no EOS / stop token yet. A grammar that allows nothing else (its
        output is complete) wins: its request may end early rather than break the grammar."""
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if len(r.output_ids) < sp.min_new_tokens:
                blocked = list(self.eos_token_ids) + list(sp.stop_token_ids or [])
                if grammar_masked and r.grammar is not None:
                    row = logits[i].clone()
                    row[blocked] = _NEG_INF
                    if not bool(torch.isfinite(row).any()):
                        continue
                    logits[i] = row
                else:
                    logits[i, blocked] = _NEG_INF

    def _choose(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        greedy = [r.sampling_params.is_greedy for r in reqs]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        next_ids = logits.argmax(dim=-1).tolist()
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = logits[rows]
        temps = torch.tensor([reqs[i].sampling_params.temperature for i in rows])
        probs = torch.softmax(sub / temps.unsqueeze(1), dim=-1)
        probs = _filter_probs(probs, [reqs[i] for i in rows])
        for j, i in enumerate(rows):
            # Exponential race: argmax(p / E) with E ~ Exp(1) is a sample from p, and it takes
            # one per-request generator call (same seed -> same tokens, whatever the batch).
            noise = torch.empty_like(probs[j]).exponential_(generator=reqs[i].generator)
            next_ids[i] = int((probs[j] / noise).argmax())
        return next_ids


def _filter_probs(probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude (rows renormalized implicitly by sampling)."""
    top_ks = [r.sampling_params.top_k for r in reqs]
    top_ps = [r.sampling_params.top_p for r in reqs]
    min_ps = [r.sampling_params.min_p for r in reqs]
    if any(p > 0 for p in min_ps):
        thresh = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps).unsqueeze(1)
        probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
    if all(k < 0 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1]).unsqueeze(0)
    ks = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_ks]).unsqueeze(1)
    keep = rank < ks
    cum = sorted_p.cumsum(dim=-1)
    # keep a token while the mass before it is below top_p (the first token always stays)
    keep &= (cum - sorted_p) < torch.tensor(top_ps).unsqueeze(1)
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
