"""Sampler: logits -> next tokens, applying penalties (DRY among them), masks, temperature,
top-k/top-p/min-p and XTC."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import numpy as np
import torch

import sglang_like_kernels
import sglang_like_kernels.cpu
import sglang_like_kernels.cpu.ops
from sglang_like.layers.dry import (
    Breaker,
    BreakerTable,
    VocabIndex,
    dry_penalties,
    resolve_breaker,
)
from sglang_like.req import Req

_NEG_INF = float("-inf")
# DRY breakers resolved against the vocabulary: per breaker (each a pass over it), and per
# list (a merge); the latest few hundred / few dozen kept
_MAX_BREAKERS_KEPT = 256
_MAX_BREAKER_TABLES = 32


class SampleOutput(NamedTuple):
    """Tokens chosen for each row, with their raw logprobs and top-k alternatives when asked."""

    next_token_ids: list[int]
    logprobs: list[float | None]  # raw model logprob of the chosen token (None if not asked)
    top_logprobs: list[list[tuple[float, int]] | None]


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """`logits.argmax(dim=-1).tolist()`, on the native kernel for CPU float32 rows (the same
    indices: first maximum, NaN as the maximum); torch's CPU argmax took 0.75 ms of a batch-32
    decode step's ~35, the kernel 0.12."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] and logits.stride(1) == 1 and sglang_like_kernels.cpu.available()):
        return sglang_like_kernels.cpu.ops.argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def select_rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits[index]: a view when the rows are consecutive (a decode batch's usually are),
    else a copy. The sampler edits its rows in place, which then land in `logits`: callers
    pass rows that nothing reads afterwards (a batch-32 step's copy took 0.5 ms)."""
    if index and index == list(range(index[0], index[0] + len(index))):
        return logits[index[0] : index[0] + len(index)]
    return logits[index]


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def top_k_entries(logprobs_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs_row, min(k, logprobs_row.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


class Sampler:
    """Stateless apart from the EOS ids and caches of DRY's breakers; per-request randomness
    lives in each Req's generator.

    `tokenizer` (its `token_bytes` and `encode`) resolves DRY's sequence breakers, which are
    text, into token ids; the engine always passes it, a unit test without DRY need not."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int], vocab_size: int,
                 tokenizer: Any = None) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._vocab_index: VocabIndex | None = None
        self._breakers: collections.OrderedDict[str, Breaker] = collections.OrderedDict()
        self._breaker_tables: collections.OrderedDict[tuple[str, ...], BreakerTable] = (
            collections.OrderedDict())

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, reqs: list[Req], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """logits [B, V] float32 (modified in place: may be a view of the forward's logits,
        which are inference tensors); bitmask int32 [B, ceil(V/32)] of allowed tokens
        (grammar masks, packed), or None."""
        batch = len(reqs)
        want_lp = [r.return_logprob for r in reqs]
        lp = raw_logprobs(logits) if any(want_lp) else None
        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        if bitmask is not None:
            sglang_like_kernels.apply_token_bitmask_(logits, bitmask.to(logits.device))
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
            if sp.has_dry:
                self._apply_dry(row, r)

    def _apply_dry(self, row: torch.Tensor, req: Req) -> None:
        """DRY over the request's context (prompt and output, as llama.cpp's), its last
        dry_penalty_last_n tokens when that is positive."""
        sp = req.sampling_params
        last_n = sp.dry_penalty_last_n
        end = req.seq_len
        ids = req.fill_slice(max(end - last_n, 0), end) if last_n > 0 else req.fill_ids
        window = np.asarray(ids, dtype=np.int64)
        found = dry_penalties(window, sp.dry_multiplier, sp.dry_base, sp.dry_allowed_length,
                              self._breaker_table(sp.dry_breakers))
        if found is not None:
            tokens, penalty = found
            keep = tokens < row.shape[0]
            row.index_add_(0, torch.from_numpy(tokens[keep]).to(row.device),
                           torch.from_numpy(-penalty[keep]).to(row.dtype).to(row.device))

    def _breaker_table(self, breakers: tuple[str, ...]) -> BreakerTable:
        """The breakers' table, resolved on first use: at 49k tokens the vocabulary's index
        takes ~0.1 s once, then a breaker new to this sampler well under 1 ms for one
        character, up to ~4 ms for 40, on the loop's thread."""
        table = _lru_get(self._breaker_tables, breakers)
        if table is None:
            table = BreakerTable([self._breaker(b) for b in breakers], self.vocab_size)
            _lru_put(self._breaker_tables, breakers, table, _MAX_BREAKER_TABLES)
        return table

    def _breaker(self, text: str) -> Breaker:
        breaker = _lru_get(self._breakers, text)
        if breaker is None:
            if self._vocab_index is None:
                if self.tokenizer is None:
                    raise RuntimeError("DRY's sequence breakers need the sampler's tokenizer")
                self._vocab_index = VocabIndex(self.tokenizer)
            breaker = resolve_breaker(text, self._vocab_index)
            _lru_put(self._breakers, text, breaker, _MAX_BREAKERS_KEPT)
        return breaker

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
        next_ids = argmax_rows(logits)
        if all(greedy):
            return next_ids
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = logits[rows]
        sampled = [reqs[i] for i in rows]
        temps = torch.tensor([r.sampling_params.temperature for r in sampled])
        probs = torch.softmax(sub / temps.unsqueeze(1), dim=-1)
        picked = _sample(probs, sampled, _xtc_thresholds(sampled))
        for j, i in enumerate(rows):
            next_ids[i] = picked[j]
        return next_ids


def _lru_get(cache: collections.OrderedDict, key: Any) -> Any:
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _lru_put(cache: collections.OrderedDict, key: Any, value: Any, max_len: int) -> None:
    cache[key] = value
    if len(cache) > max_len:
        cache.popitem(last=False)


# Top-k / top-p rows are cut from their top 64 candidates (torch.topk), or 1024 where those
# hold less mass than top_p, or the whole sorted vocabulary where those do: the kept set is a
# prefix of the sorted row, so it is exact once the candidates hold it. Sorting the whole
# vocabulary of every row measured half of a sampled batch-128 decode step.
_CANDIDATES = (64, 1024)


def _xtc_thresholds(reqs: list[Req]) -> torch.Tensor | None:
    """XTC's per-row threshold for this step (+inf where it does not act), or None when no row
    asks. A row asking draws from its own generator whether XTC acts this step (chance <=
    xtc_probability, as llama.cpp's), so a seed reproduces the choice."""
    rows = [j for j, r in enumerate(reqs) if r.sampling_params.xtc_probability > 0.0]
    if not rows:
        return None
    out = torch.full((len(reqs),), float("inf"))
    for j in rows:
        sp = reqs[j].sampling_params
        if float(torch.rand(1, generator=reqs[j].generator)) <= sp.xtc_probability:
            out[j] = sp.xtc_threshold
    return out


def _exclude_top_choices(weights: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """XTC on rows of non-negative `weights` [R, W] (the candidates truncation kept): where
    two or more hold at least `thresholds` [R] of their row's mass, all of them but the least
    likely (the first such in row order among equals) get weight 0."""
    share = weights / weights.sum(dim=-1, keepdim=True)
    above = (weights > 0) & (share >= thresholds.unsqueeze(1))
    acts = above.sum(dim=-1) >= 2
    if not bool(acts.any()):
        return weights
    spared = torch.where(above, share, torch.full_like(share, float("inf"))).argmin(dim=-1)
    drop = above & acts.unsqueeze(1)
    drop[torch.arange(len(weights)), spared] = False
    return weights.masked_fill(drop, 0.0)


def _sample(probs: torch.Tensor, reqs: list[Req], xtc: torch.Tensor | None = None) -> list[int]:
    """One token per row of `probs` [R, V], drawn from it after min-p, top-k, top-p and then
    XTC (`xtc`: per-row thresholds from `_xtc_thresholds`; rows renormalized implicitly), by
    inverse CDF with one uniform from each request's generator: the same seed draws the same
    tokens whatever else is in the batch."""
    vocab = probs.shape[-1]
    top_ks = [r.sampling_params.top_k for r in reqs]
    top_ps = [r.sampling_params.top_p for r in reqs]
    min_ps = [r.sampling_params.min_p for r in reqs]
    if any(p > 0 for p in min_ps):
        thresh = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps).unsqueeze(1)
        probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
    uniform = torch.cat([torch.rand(1, generator=r.generator) for r in reqs])
    out = [0] * len(reqs)
    is_cut = [k > 0 or p < 1.0 for k, p in zip(top_ks, top_ps, strict=True)]
    cut = [i for i, c in enumerate(is_cut) if c]
    full = [i for i, c in enumerate(is_cut) if not c]
    if full:  # the whole distribution: its CDF over the vocabulary in id order
        weights = probs[full]
        if xtc is not None:
            weights = _exclude_top_choices(weights, xtc[full])
        ids = inverse_cdf(weights, uniform[full])
        for j, i in enumerate(full):
            out[i] = int(ids[j])
    pending = cut
    for width in (*_CANDIDATES, vocab):
        if not pending:
            break
        ks = torch.tensor([top_ks[i] for i in pending])
        tps = torch.tensor([top_ps[i] for i in pending])
        k = min(vocab, max(width, int(ks.max())))
        rows = probs[pending]
        if k < vocab:
            sorted_p, order = rows.topk(k, dim=-1)  # descending
            held = ((ks > 0) & (ks <= k)) | (sorted_p.sum(dim=-1) >= tps)
        else:
            sorted_p, order = rows.sort(dim=-1, descending=True)
            held = torch.ones(len(pending), dtype=torch.bool)
        kept = keep_top(sorted_p, ks, tps)
        if xtc is not None:  # exact on held rows: their kept set lies within the candidates
            kept = _exclude_top_choices(kept, xtc[pending])
        pos = inverse_cdf(kept, uniform[pending])
        chosen = order.gather(1, pos.unsqueeze(1)).squeeze(1).tolist()
        for j, ok in enumerate(held.tolist()):
            if ok:
                out[pending[j]] = chosen[j]
        pending = [i for i, ok in zip(pending, held.tolist(), strict=True) if not ok]
    return out


def keep_top(sorted_p: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
              ) -> torch.Tensor:
    """Zero what top-k and top-p exclude from rows sorted descending: a token stays while its
    rank is below k and the mass ranked before it is below top_p (the first always stays)."""
    width = sorted_p.shape[-1]
    rank = torch.arange(width, device=sorted_p.device).unsqueeze(0)
    keep = rank < torch.where(top_ks > 0, top_ks, width).unsqueeze(1)
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < top_ps.unsqueeze(1)
    return torch.where(keep, sorted_p, torch.zeros_like(sorted_p))


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative `weights` [R, W], the index whose CDF interval holds
    uniform * total; never a zero-weight entry (float rounding at the top end included)."""
    cdf = weights.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    width = weights.shape[-1]
    positions = torch.arange(width, device=weights.device)
    last = torch.where(weights > 0, positions, -1).max(dim=-1).values
    return torch.minimum(idx, last.clamp(min=0))
