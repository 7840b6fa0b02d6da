"""DRY ("don't repeat yourself", llama.cpp's sampler): the logit penalty on tokens that would
extend a repeat of the context, and the sequence breakers resolved against the vocabulary.

The rule, for a context window w[0..n-1] (the last dry_penalty_last_n tokens, or all):

1. The most recent sequence breaker caps how far back a repeat may reach: `rep_limit` is the
   number of tokens after it (a multi-token breaker counts from its end). No breaker: n.
   No penalty when rep_limit < allowed_length (the text just restarted).
2. For every earlier end position j < n-1, `match[j]` is the length of the longest common
   suffix of w[..j] and w (the whole window), capped at rep_limit.
3. Where match[j] >= allowed_length, emitting w[j+1] next would make the repeat one longer:
   that token loses multiplier * base ** (match[j] - allowed_length) (its longest such
   match counts; the exponent is clamped so the power stays a float32).
4. A token that is on its own a sequence breaker is never penalized.

`dry_penalties` finds the candidates of step 2 with one vectorized compare and extends them
in blocks of `_BLOCK` tokens, so a step costs a few numpy calls even when a repeat is long;
step 1 looks only as far back as the longest match could reach.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

_BLOCK = 32
# a multi-token breaker's tail is cut to this many tokens (llama.cpp's bound on the scan)
_MAX_TAIL_TOKENS = 20
_FLOAT32_MAX_LOG = 88.7228391
# the penalty stays finite (a fully penalized grammar row must still have a finite maximum,
# and a temperature divide must not overflow it)
_MAX_PENALTY = 1e30

Tail = tuple[int, ...]


class Breaker(NamedTuple):
    """One sequence breaker as token ids: the tokens holding all of it (`alone`), and each
    way it can start at the end of a token: (the tokens after, the tokens it can end)."""

    alone: np.ndarray  # int64 token ids
    split: tuple[tuple[Tail, frozenset[int]], ...]


class VocabIndex:
    """The vocabulary's bytes (`tokenizer.token_bytes`) indexed for breaker lookups: the
    tokens holding each byte value, and the tokens sorted by their reversed bytes (those
    ending with a given suffix are a run of it); with `tokenizer.encode`. Built once (~0.1 s
    at 49k tokens), so a breaker costs about its number of matches."""

    def __init__(self, tokenizer: Any) -> None:
        self.token_bytes: Sequence[bytes] = tokenizer.token_bytes
        self.encode = tokenizer.encode
        holders: list[list[int]] = [[] for _ in range(256)]
        for tok, piece in enumerate(self.token_bytes):
            for byte in set(piece):
                holders[byte].append(tok)
        self._holding = [np.array(h, dtype=np.int64) for h in holders]
        self._reversed_ids = sorted(range(len(self.token_bytes)),
                                    key=lambda tok: self.token_bytes[tok][::-1])
        self._reversed = [self.token_bytes[tok][::-1] for tok in self._reversed_ids]

    def containing(self, needle: bytes) -> np.ndarray:
        """The tokens whose bytes contain `needle` (not empty)."""
        holders = sorted((self._holding[byte] for byte in set(needle)), key=len)
        found = holders[0]
        for other in holders[1:]:
            found = np.intersect1d(found, other, assume_unique=True)
        if len(needle) == 1:
            return found
        return np.array([tok for tok in found.tolist() if needle in self.token_bytes[tok]],
                        dtype=np.int64)

    def ending_with(self, suffix: bytes) -> list[int]:
        """The tokens whose bytes end with `suffix` (not empty): the run of reversed byte
        strings from `suffix` reversed up to the first string past all it starts."""
        key = suffix[::-1]
        lo = bisect.bisect_left(self._reversed, key)
        stem = key.rstrip(b"\xff")
        if not stem:
            return self._reversed_ids[lo:]
        past = stem[:-1] + bytes([stem[-1] + 1])
        return self._reversed_ids[lo : bisect.bisect_left(self._reversed, past)]


def resolve_breaker(text: str, vocab: VocabIndex) -> Breaker:
    """One breaker against the vocabulary, by bytes: a token containing it is a breaker
    alone; a token ending with a proper prefix of it (and not holding all of it) starts it,
    the rest tokenized being its tail (the first `_MAX_TAIL_TOKENS` tokens)."""
    needle = text.encode("utf-8")
    alone = vocab.containing(needle)
    held = set(alone.tolist())
    split = []
    for k in range(1, len(needle)):
        heads = frozenset(vocab.ending_with(needle[:k])) - held
        if not heads:
            continue
        try:
            rest = needle[k:].decode("utf-8")
        except UnicodeDecodeError:
            continue  # the cut falls inside a character: no tokenization of it
        tail = tuple(vocab.encode(rest)[:_MAX_TAIL_TOKENS])
        if tail:
            split.append((tail, heads))
    return Breaker(alone, tuple(split))


class BreakerTable:
    """Several breakers over a vocabulary of `width` (at least the logits'): `is_single[t]`,
    token t holds a whole breaker; `is_head[t]`, a breaker can start at t; `tails(t)`, the
    token sequences that complete a breaker after t (`()` for a whole one), longest first."""

    def __init__(self, breakers: Sequence[Breaker], width: int) -> None:
        top = [int(b.alone.max()) for b in breakers if len(b.alone)]
        top += [max(heads) for b in breakers for _, heads in b.split]
        width = max([width, *(t + 1 for t in top)])
        self.is_single = np.zeros(width, dtype=bool)
        self._split = [pair for b in breakers for pair in b.split]
        for b in breakers:
            self.is_single[b.alone] = True
        self.is_head = self.is_single.copy()
        for _, heads in self._split:
            self.is_head[list(heads)] = True
        self._tails: dict[int, tuple[Tail, ...]] = {}  # filled as tokens are asked about

    def tails(self, tok: int) -> tuple[Tail, ...]:
        found = self._tails.get(tok)
        if found is None:
            seqs = {tail for tail, heads in self._split if tok in heads}
            if self.is_single[tok]:
                seqs.add(())
            found = self._tails[tok] = tuple(sorted(seqs, key=len, reverse=True))
        return found


def repeat_limit(window: np.ndarray, table: BreakerTable, horizon: int) -> int:
    """Step 1: the tokens after the most recent complete breaker whose first token lies in
    the last `horizon` tokens; len(window) when there is none."""
    n = len(window)
    first = max(n - horizon, 0)
    heads = np.flatnonzero(table.is_head[window[first:]]) + first
    for pos in heads[::-1].tolist():
        after = n - 1 - pos  # tokens after the head
        for tail in table.tails(int(window[pos])):  # longest first
            if len(tail) <= after and tuple(window[pos + 1 : pos + 1 + len(tail)].tolist()) == tail:
                return after - len(tail)
    return n


def match_lengths(window: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 2 before the cap: (end positions j, min(match[j], limit)) for the j < n-1 whose
    match is at least 1."""
    last = len(window) - 1
    ends = np.flatnonzero(window[:last] == window[last])
    lengths = np.ones(len(ends), dtype=np.int64)
    # -1 never equals a token id: a match stops at the window's start
    padded = np.concatenate([np.full(_BLOCK, -1, dtype=window.dtype), window])
    steps = np.arange(_BLOCK)
    active = np.arange(len(ends))
    done = 1  # tokens matched so far by every active end
    while len(active) and done < limit:
        back = done + steps  # compare w[j - back] with w[last - back]
        left = padded[_BLOCK + ends[active, None] - back]
        right = padded[_BLOCK + last - back]
        differ = left != right
        stopped = differ.any(axis=1)
        lengths[active] = done + np.where(stopped, differ.argmax(axis=1), _BLOCK)
        active = active[~stopped]
        done += _BLOCK
    return ends, np.minimum(lengths, limit)


def _saturation(multiplier: float, base: float) -> int | None:
    """The exponent past which the penalty no longer grows (the float32 clamp, or the finite
    bound), or None where it keeps growing (a base within 1e-6 above 1)."""
    if base == 1.0:
        return 0
    if base <= 1.000001:
        return None
    to_bound = math.ceil(math.log(_MAX_PENALTY / multiplier) / math.log(base))
    return max(0, min(math.floor(_FLOAT32_MAX_LOG / math.log(base)), to_bound))


def dry_penalties(window: np.ndarray, multiplier: float, base: float, allowed_len: int,
                  table: BreakerTable) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, penalty to subtract from each one's logit), or None when nothing is
    penalized. `window`: int64 token ids, oldest first."""
    if len(window) <= allowed_len:
        return None
    # longer matches than where the penalty saturates need not be measured: a pathological
    # loop of thousands of tokens costs a few blocks
    saturation = _saturation(multiplier, base)
    limit = len(window) if saturation is None else allowed_len + saturation + 1
    ends, lengths = match_lengths(window, limit)
    if not len(ends) or int(lengths.max()) < allowed_len:
        return None
    # a breaker whose head is further back than the longest match (plus a tail) caps nothing
    # more than the saturation does
    cap = repeat_limit(window, table, int(lengths.max()) + _MAX_TAIL_TOKENS + 1)
    if cap < allowed_len:
        return None
    lengths = np.minimum(lengths, cap)
    hit = lengths >= allowed_len
    tokens, lengths = window[ends[hit] + 1], lengths[hit]
    order = np.argsort(tokens, kind="stable")
    tokens, lengths = tokens[order], lengths[order]
    ids, starts = np.unique(tokens, return_index=True)
    longest = np.maximum.reduceat(lengths, starts)
    keep = ~table.is_single[ids]
    ids, longest = ids[keep], longest[keep]
    if len(ids) == 0:
        return None
    exponent = (longest - allowed_len).astype(np.float64)
    if base > 1.000001:
        exponent = np.minimum(exponent, math.floor(_FLOAT32_MAX_LOG / math.log(base)))
    penalty = np.minimum(multiplier * np.power(base, exponent), _MAX_PENALTY)
    return ids, penalty
