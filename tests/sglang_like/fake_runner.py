"""A scripted model runner for Scheduler.step() tests: no weights, but a real KV contract.

It stores each new token id in its "KV pool" at the token's slot, and reads a request's whole
sequence back through req_to_token when it must produce logits. The next token is a hash of
that sequence, so any mix-up of KV slots (a wrong prefix match, a slot freed while in use, a
row written in the wrong place) changes the output, which the tests compare against the same
hash computed from the true sequence.
"""

from __future__ import annotations

import torch

from sglang_like.mem_pool import ReqToTokenPool
from sglang_like.schedule_batch import ScheduleBatch

VOCAB = 2048
FIRST_TOKEN = 300  # scripted tokens stay in [FIRST_TOKEN, FIRST_TOKEN + SPAN): plain text
SPAN = 1000


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1000003 + t + 1) % 2147483647
    return FIRST_TOKEN + h % SPAN


def expected_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class ScriptedDrafter:
    """Drafts trees whose first `right` tokens follow the script and then go wrong, with a
    wrong sibling at every depth: verifies accept a known number of tokens."""

    def __init__(self, depth: int, right: int, branch: bool = True) -> None:
        self.depth, self.right, self.branch = depth, right, branch
        self.num_draft_tokens = 1 + depth * (2 if branch else 1)
        self.num_proposed = 0

    def propose(self, reqs, max_depths, ctx):
        trees = []
        for req, cap in zip(reqs, max_depths, strict=True):
            from sglang_like.speculative.tree import DraftTree

            seq = list(req.fill_ids)
            tokens, parents = [seq[-1]], [-1]
            node = 0
            for d in range(min(self.depth, cap)):
                true = next_token(seq)
                tok = true if d < self.right else FIRST_TOKEN + (true + 7) % SPAN
                if self.branch:  # a wrong sibling first: the walk must pick the right child
                    tokens.append(FIRST_TOKEN + (true + 13) % SPAN)
                    parents.append(node)
                tokens.append(tok)
                parents.append(node)
                node = len(tokens) - 1
                seq.append(tok)
            self.num_proposed += 1
            trees.append(DraftTree(tokens, parents))
        return trees


class FakeRunner:
    def __init__(self, num_slots: int, max_rows: int, context_len: int) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_rows, context_len, "cpu")
        self.slot_tokens = [-1] * (num_slots + 1)
        self.batches: list[ScheduleBatch] = []

    def forward(self, batch: ScheduleBatch, to_host: bool = True) -> torch.Tensor:
        """Logits on the host (`to_host=False`, the device sampler's call, changes nothing)."""
        self.batches.append(batch)
        for slot, tok in zip(batch.out_slots, batch.input_ids, strict=True):
            assert self.slot_tokens[slot] == -1 or slot != 0, "slot 0 is padding"
            self.slot_tokens[slot] = tok
        table = self.req_to_token_pool.req_to_token
        # the slots each token row attends to: its prefix, then itself causally, or (a tree
        # node of a verify) its ancestors and itself
        keys_of_row: list[list[int]] = []
        start = 0
        for i, req in enumerate(batch.reqs):
            prefix = table[req.req_pool_idx, : batch.prefix_lens[i]].tolist()
            tree = batch.trees[i] if batch.trees else None
            for j in range(batch.extend_lens[i]):
                if tree is None:
                    own = batch.out_slots[start : start + j + 1]
                else:
                    chain, node = [], j
                    while node >= 0:
                        chain.append(batch.out_slots[start + node])
                        node = tree.parents[node]
                    own = chain[::-1]
                keys_of_row.append(prefix + own)
            start += batch.extend_lens[i]
        logits = torch.full((len(batch.logits_rows), VOCAB), -10.0)
        for k, token_row in enumerate(batch.logits_rows):
            seq = [self.slot_tokens[s] for s in keys_of_row[token_row]]
            assert -1 not in seq, "read a slot nobody wrote"
            logits[k, next_token(seq)] = 10.0
        return logits
