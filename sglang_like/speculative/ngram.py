"""N-gram (prompt-lookup) drafting: continue the request's own text where its last tokens
appeared before. No model: copy-heavy work (extraction, editing, RAG, code) gains most."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_like.speculative.tree import DraftTree

if TYPE_CHECKING:
    from sglang_like.req import Req


class NgramIndex:
    """Where each n-gram (min_window <= n <= max_window) of one request's tokens last ended.

    Built incrementally: every n-gram ending before the last token is indexed, so the suffix
    ending at the last token is looked up against earlier text only.
    """

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.last_end: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the table

    def sync(self, seq: list[int]) -> None:
        for end in range(self.indexed, len(seq) - 1):
            for n in range(self.min_window, min(self.max_window, end + 1) + 1):
                key = tuple(seq[end - n + 1 : end + 1])
                ends = self.last_end.setdefault(key, [])
                ends.append(end + 1)  # where the continuation starts
                if len(ends) > 4:
                    del ends[0]
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
        for n in range(min(self.max_window, len(seq) - 1), self.min_window - 1, -1):
            for start in reversed(self.last_end.get(tuple(seq[-n:]), ())):
                cont = seq[start : start + min(length, 2 * n)]
                if cont and cont not in found:
                    longest = longest or n  # n only falls: the first match is the longest
                    found.append(cont)
                    if len(found) >= breadth:
                        return found, longest
        return found, longest


class NgramDrafter:
    """Proposes a tree of up to `num_draft_tokens` nodes (root included) per request."""

    # drafting is a few dict lookups: the controller judges the drafted trees themselves
    drafts_cheaply = True

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int,
                 breadth: int) -> None:
        self.num_draft_tokens = num_draft_tokens  # tree nodes, root included
        self.min_window = min_window
        self.max_window = max_window
        self.breadth = breadth

    def propose(self, reqs: list[Req], max_depths: list[int], sched: object = None
                ) -> list[DraftTree | None]:
        return [self.propose_one(r, d) for r, d in zip(reqs, max_depths, strict=True)]

    def propose_one(self, req: Req, max_depth: int) -> DraftTree | None:
        """None when nothing matches (the request decodes one token as usual)."""
        index = req.spec.ngram
        if index is None or index.indexed > req.seq_len:  # new, or the tokens were rewritten
            index = req.spec.ngram = NgramIndex(self.min_window, self.max_window)
        seq = req.fill_ids
        conts, matched = index.continuations(seq, min(max_depth, self.num_draft_tokens - 1),
                                             self.breadth)
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
        return DraftTree(tokens, parents, evidence=matched) if len(tokens) > 1 else None
