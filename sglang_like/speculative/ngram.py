"""N-gram (prompt-lookup) drafting: continue the request's own text where its last tokens
appeared before, or a recent request's text where they appeared there (SGLang's NGRAM drafts
from every request's tokens; SuffixDecoding's observation: agent and extraction traffic
repeats itself across requests). No model: copy-heavy work (extraction, editing, RAG, code)
gains most."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from sglang_like.speculative.tree import DraftTree

if TYPE_CHECKING:
    from sglang_like.req import Req
    from sglang_like.speculative.context import DraftContext


# The tables key an n-gram by an integer hash and keep integers as values, built without a
# tuple per n-gram: a request adds max_window keys a token, and the tuples and lists they
# were (tracked objects) set off a cyclic-GC pass every other step at batch 32, 4-5% of the
# step time (0.2-0.3 s of a 6 s run in collections). A hash collision is caught where a
# match is read back (the text at the match is compared with the suffix).
_MASK64 = (1 << 64) - 1
_MUL = 0x100000001B3  # FNV-1a's 64-bit prime


def _suffix_hashes(seq: list[int], end: int, min_n: int, max_n: int):
    """(n, hash of seq[end - n + 1 : end + 1]) for n = 1.. up to max_n tokens ending at
    `end` (those with n >= min_n), growing leftwards: one multiply-xor a token."""
    h = 0xCBF29CE484222325
    for n in range(1, min(max_n, end + 1) + 1):
        h = ((h ^ (seq[end - n + 1] + n)) * _MUL) & _MASK64
        if n >= min_n:
            yield n, h


def _all_hashes(seq: list[int], first: int, stop: int, min_n: int, max_n: int
                ) -> tuple[list[int], list[int]]:
    """Every (hash, end) `_suffix_hashes` gives for the ends first .. stop - 1, in its order
    (end by end, n growing), computed with numpy over all ends at once: the same FNV-style
    steps in uint64, which wraps as the masked Python ints do. A 400-token text's 4,800
    hashes took 0.97 ms through the generator and take 0.24 here; at batch 32 every request
    pays them at its first lookup and again when it ends."""
    if stop <= first:
        return [], []
    base = max(0, first - max_n + 1)
    toks = np.asarray(seq[base:stop], dtype=np.uint64)
    ends = np.arange(first, stop)
    h = np.full(ends.shape, 0xCBF29CE484222325, dtype=np.uint64)
    mul = np.uint64(_MUL)
    cols, masks = [], []
    for n in range(1, max_n + 1):
        idx = ends - n + 1
        fits = idx >= 0
        h = (h ^ (toks[np.maximum(idx, 0) - base] + np.uint64(n))) * mul
        if n >= min_n:
            cols.append(h)
            masks.append(fits)
    if not cols:
        return [], []
    keep = np.stack(masks, axis=1)  # [ends, n]: row-major is end by end, n growing
    hashes = np.stack(cols, axis=1)[keep]
    at = np.broadcast_to(ends[:, None], keep.shape)[keep]
    return hashes.tolist(), at.tolist()


# a sync of at least this many new ends hashes them with numpy (fewer: one at a time)
_BULK_ENDS = 16

# NgramIndex keeps up to _KEPT_ENDS ends per n-gram, newest in the low bits of one integer
_KEPT_ENDS = 4
_END_BITS = 40
_END_MASK = (1 << _END_BITS) - 1
_KEPT_MASK = (1 << (_END_BITS * _KEPT_ENDS)) - 1


class NgramIndex:
    """Where each n-gram (min_window <= n <= max_window) of one request's tokens ended most
    recently (its last _KEPT_ENDS occurrences).

    Built incrementally: every n-gram ending before the last token is indexed, so the suffix
    ending at the last token is looked up against earlier text only.
    """

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        # n-gram hash -> its continuation starts (end + 1), _END_BITS each, newest lowest
        self.last_end: dict[int, int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the table

    def sync(self, seq: list[int]) -> None:
        table, lo, hi = self.last_end, self.min_window, self.max_window
        if len(seq) - 1 - self.indexed >= _BULK_ENDS:  # a prompt: its hashes at once
            keys, ends = _all_hashes(seq, self.indexed, len(seq) - 1, lo, hi)
            for h, end in zip(keys, ends, strict=True):
                table[h] = ((table.get(h, 0) << _END_BITS) | (end + 1)) & _KEPT_MASK
        else:
            for end in range(self.indexed, len(seq) - 1):
                for _, h in _suffix_hashes(seq, end, lo, hi):
                    table[h] = ((table.get(h, 0) << _END_BITS) | (end + 1)) & _KEPT_MASK
        self.indexed = max(self.indexed, len(seq) - 1)

    def continuations(self, seq: list[int], length: int, breadth: int
                      ) -> tuple[list[list[int]], int]:
        """(up to `breadth` distinct continuations of `seq`'s suffix, the longest matched
        suffix length): longest match first, the most recent occurrence first among equals;
        each at most `length` tokens, and at most twice the matched length (a one-token match
        is weak evidence: a short draft costs a short verify)."""
        self.sync(seq)
        found: list[list[int]] = []
        longest = 0
        hashes = list(_suffix_hashes(seq, len(seq) - 1, self.min_window,
                                     min(self.max_window, len(seq) - 1)))
        for n, h in reversed(hashes):
            starts = self.last_end.get(h, 0)
            suffix = seq[-n:] if starts else None
            while starts:
                start, starts = starts & _END_MASK, starts >> _END_BITS
                if seq[start - n : start] != suffix:
                    continue  # another n-gram with the same hash
                cont = seq[start : start + min(length, 2 * n)]
                if cont and cont not in found:
                    longest = longest or n  # n only falls: the first match is the longest
                    found.append(cont)
                    if len(found) >= breadth:
                        return found, longest
        return found, longest


class _Generation:
    """Texts added one after another, and where each of their n-grams last ended."""

    __slots__ = ("texts", "latest", "num_tokens")

    def __init__(self) -> None:
        self.texts: dict[int, list[int]] = {}  # text id -> tokens
        # n-gram hash -> text id << _END_BITS | end (where its continuation starts)
        self.latest: dict[int, int] = {}
        self.num_tokens = 0


class RecentTexts:
    """The token ids of recently finished requests, at most `capacity` tokens in all, and
    where each of their n-grams (min_window <= n <= max_window) last ended.

    One table per generation, keyed by the n-gram's hash (a collision is caught when the
    match is read back), so a lookup costs a dict probe or two per n whatever the number of
    texts. Texts enter the young generation; once it holds half the capacity it becomes the
    old one, and the old one before it is dropped whole (as is the old one when the two
    together outgrow the capacity), so from about half the capacity (less one text) to all of
    it is kept.
    Dropping a text one at a time meant recomputing its keys and deleting each that still
    pointed at it, on the scheduler's thread for every finished request: an add cost 3.4 ms
    on average once full (400-token texts, windows 1-12); now 0.9, a generation's drop (its
    table freed in C) 5-7 ms once in about 40 adds.
    """

    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self._young = _Generation()
        self._old = _Generation()
        self._next_id = 0

    @property
    def num_tokens(self) -> int:
        return self._young.num_tokens + self._old.num_tokens

    @property
    def num_texts(self) -> int:
        return len(self._young.texts) + len(self._old.texts)

    def add(self, text: list[int]) -> None:
        if len(text) < 2 or len(text) > self.capacity:
            return
        young = self._young
        tid, self._next_id = self._next_id, self._next_id + 1
        young.texts[tid] = text
        young.num_tokens += len(text)
        # every n-gram but those ending at the last token, which continues nowhere
        keys, ends = _all_hashes(text, 0, len(text) - 1, self.min_window, self.max_window)
        tag = tid << _END_BITS
        young.latest.update(zip(keys, [tag | (end + 1) for end in ends], strict=True))
        if self.num_tokens > self.capacity:
            self._old = _Generation()
        if 2 * young.num_tokens >= self.capacity:
            self._old, self._young = young, _Generation()

    def clear(self) -> None:
        self._young = _Generation()
        self._old = _Generation()

    def continuation(self, seq: list[int], length: int, min_match: int
                     ) -> tuple[list[int], int]:
        """(a continuation of `seq`'s suffix from the most recent text where the longest
        suffix of at least `min_match` tokens appeared, that length); ([], 0) when none.
        At most `length` tokens, and at most twice the matched length (as NgramIndex)."""
        lo = max(self.min_window, min_match)
        hashes = list(_suffix_hashes(seq, len(seq) - 1, lo, min(self.max_window, len(seq))))
        for n, h in reversed(hashes):
            for gen in (self._young, self._old):  # the newer first
                hit = gen.latest.get(h)
                if hit is None:
                    continue
                text = gen.texts[hit >> _END_BITS]
                start = hit & _END_MASK
                if text[start - n : start] == seq[-n:]:
                    cont = text[start : start + min(length, 2 * n)]
                    if cont:
                        return cont, n
        return [], 0


class NgramDrafter:
    """Proposes a tree of up to `num_draft_tokens` nodes (root included) per request.

    Continuations come from the request's own text (`NgramIndex`), and, where a finished
    request's text (`RecentTexts`, `capacity` tokens) matches a longer suffix, first from
    there. A tree's `evidence` is its longest match: positive from its own text, negative
    from another's (the controller learns what each kind commits)."""

    # drafting is a few dict lookups: the controller judges the drafted trees themselves
    drafts_cheaply = True

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int,
                 breadth: int, capacity: int = 0) -> None:
        self.num_draft_tokens = num_draft_tokens  # tree nodes, root included
        self.min_window = min_window
        self.max_window = max_window
        self.breadth = breadth
        self.capacity = capacity
        # finished texts per tenant (the radix cache's namespaces): a tenant's request drafts
        # only from its own tenant's texts, since acceptance (spec_verify_ct, the speed) would
        # otherwise tell it what another tenant wrote. The shared part keeps `capacity`
        # tokens; the most recent TENANT_TEXTS tenants an eighth each (bounded memory whatever
        # cache salts clients send)
        self._recent: OrderedDict[int | None, RecentTexts] = OrderedDict()

    TENANT_TEXTS = 8

    def _texts(self, namespace: int | None, create: bool) -> RecentTexts | None:
        texts = self._recent.get(namespace)
        if texts is None and create and self.capacity > 0:
            size = self.capacity if namespace is None else max(self.capacity // 8, 1)
            texts = self._recent[namespace] = RecentTexts(self.min_window, self.max_window,
                                                          size)
            tenants = [k for k in self._recent if k is not None]
            if len(tenants) > self.TENANT_TEXTS:
                del self._recent[tenants[0]]  # the least recently finished-into tenant
        if texts is not None and namespace is not None:
            self._recent.move_to_end(namespace)
        return texts

    def finished(self, req: Req) -> None:
        """A request ended: its text (prompt and output) becomes draftable for others of its
        tenant."""
        texts = self._texts(req.cache_namespace, create=True)
        if texts is not None:
            texts.add(req.fill_ids)

    def flush(self) -> None:
        """Forget every finished request's text (with the radix cache's flush)."""
        self._recent.clear()

    def propose(self, reqs: list[Req], max_depths: list[int], ctx: DraftContext | None = None
                ) -> list[DraftTree | None]:
        """A tree per request (None: nothing matches); lookups need nothing of `ctx`."""
        return [self.propose_one(r, d) for r, d in zip(reqs, max_depths, strict=True)]

    def propose_one(self, req: Req, max_depth: int) -> DraftTree | None:
        """None when nothing matches (the request decodes one token as usual)."""
        index = req.spec.ngram
        if index is None or index.indexed > req.seq_len:  # new, or the tokens were rewritten
            index = req.spec.ngram = NgramIndex(self.min_window, self.max_window)
        seq = req.fill_ids
        depth = min(max_depth, self.num_draft_tokens - 1)
        conts, matched = index.continuations(seq, depth, self.breadth)
        evidence = matched
        recent = self._recent.get(req.cache_namespace)
        if recent is not None:
            other, other_matched = recent.continuation(seq, depth, matched + 1)
            if other and other not in conts:
                conts = [other, *conts][: self.breadth]
                evidence = -other_matched
        if req.images:  # an image's pad ids are no token to draft: cut a continuation there
            pads = {item.pad_value for item in req.images}
            conts = [c[:next((k for k, t in enumerate(c) if t in pads), len(c))] for c in conts]
            conts = [c for c in conts if c]
        if not conts:
            return None
        # merge the continuations into a trie of at most num_draft_tokens nodes
        tokens, parents = [seq[-1]], [-1]
        children: dict[tuple[int, int], int] = {}
        for cont in conts:
            node = 0
            for tok in cont:
                nxt = children.get((node, tok))
                if nxt is None:
                    if len(tokens) >= self.num_draft_tokens:
                        break
                    nxt = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    children[(node, tok)] = nxt
                node = nxt
        return DraftTree(tokens, parents, evidence=evidence) if len(tokens) > 1 else None
