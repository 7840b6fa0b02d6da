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


class FakeRunner:
    def __init__(self, num_slots: int, max_rows: int, context_len: int) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_rows, context_len, "cpu")
        self.slot_tokens = [-1] * (num_slots + 1)
        self.batches: list[ScheduleBatch] = []

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        self.batches.append(batch)
        for slot, tok in zip(batch.out_slots, batch.input_ids, strict=True):
            assert self.slot_tokens[slot] == -1 or slot != 0, "slot 0 is padding"
            self.slot_tokens[slot] = tok
        row_of_token: list[tuple[int, int]] = []
        for i, req in enumerate(batch.reqs):
            for j in range(batch.extend_lens[i]):
                row_of_token.append((req.req_pool_idx, batch.prefix_lens[i] + j))
        logits = torch.full((len(batch.logits_rows), VOCAB), -10.0)
        table = self.req_to_token_pool.req_to_token
        for k, token_row in enumerate(batch.logits_rows):
            row, pos = row_of_token[token_row]
            slots = table[row, : pos + 1].tolist()
            seq = [self.slot_tokens[s] for s in slots]
            assert -1 not in seq, "read a slot nobody wrote"
            logits[k, next_token(seq)] = 10.0
        return logits
