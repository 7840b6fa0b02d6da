"""ScheduleBatch: what the scheduler decided to run this step, as plain Python lists.

A leaf beside `forward_batch`, not in `scheduler/`: the model runner turns it into a
ForwardBatch and drafters read it after the forward, and both sit below the scheduler. A
verify's tree is typed by what the batch and the runner read of it (`VerifyTree`), so this
module needs nothing from `speculative` (whose `DraftTree` is the one the scheduler puts in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sglang_like.req import Req

if TYPE_CHECKING:
    import torch


class VerifyTree(Protocol):
    """What a batch and the model runner read of a draft tree (`speculative.tree.DraftTree`):
    its node tokens (node 0: the root), each node's depth, and its attention mask."""

    tokens: list[int]
    depth: list[int]

    @property
    def num_nodes(self) -> int: ...

    def mask(self) -> torch.Tensor:
        """bool [N, N]: node i sees node j iff j is i or an ancestor of i."""
        ...


@dataclass
class ScheduleBatch:
    """One mixed forward: for each request, `extend_lens[i]` new tokens after `prefix_lens[i]`.

    Decode requests are extends of one token. `logits_rows` are token rows (indices into the
    packed new tokens) whose logits the scheduler needs; `sample_index[i]` is the position in
    logits_rows of request i's sampling row (-1: this forward does not finish its prefill),
    and `input_logprob_rows[i]` the (position in logits_rows, target token, prompt position)
    triples of its prompt-logprob rows.
    """

    reqs: list[Req] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    input_logprob_rows: list[list[tuple[int, int, int]]] = field(default_factory=list)
    # a speculative verify: request i's rows are its tree's nodes (else None); its logits
    # rows are all N nodes, from sample_index[i] on
    trees: list[VerifyTree | None] = field(default_factory=list)
    # ForwardBatch.on_layer for this forward (a prefill worker streaming KV out), or None
    on_layer: Callable[[int], None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens) and not self.has_trees

    @property
    def has_trees(self) -> bool:
        return any(t is not None for t in self.trees)

    def add_tree(self, req: Req, tree: VerifyTree, slots: list[int]) -> None:
        """Append a verify of `tree` (root = req's last token) on freshly allocated slots."""
        start_row = len(self.input_ids)
        self.reqs.append(req)
        self.prefix_lens.append(req.kv_len)
        self.extend_lens.append(tree.num_nodes)
        self.input_ids += tree.tokens
        self.out_slots += slots
        self.input_logprob_rows.append([])
        self.sample_index.append(len(self.logits_rows))
        self.logits_rows += range(start_row, start_row + tree.num_nodes)
        self.trees.append(tree)

    def add(self, req: Req, extend_len: int, slots: list[int]) -> None:
        """Append req's next `extend_len` tokens, with their freshly allocated KV slots."""
        start_row = len(self.input_ids)
        prefix_len = req.kv_len
        self.reqs.append(req)
        self.prefix_lens.append(prefix_len)
        self.extend_lens.append(extend_len)
        self.input_ids += req.fill_slice(prefix_len, prefix_len + extend_len)
        self.out_slots += slots
        # prompt logprobs: the row of position p-1 predicts token p
        lp_rows: list[tuple[int, int, int]] = []
        if req.wants_input_logprobs:
            end = min(prefix_len + extend_len + 1, req.prompt_len)
            prompt = req.origin_input_ids  # prompt logprobs only ever cover prompt positions
            for pos in range(max(req.input_logprob_next_pos, prefix_len + 1), end):
                lp_rows.append((len(self.logits_rows), prompt[pos], pos))
                self.logits_rows.append(start_row + (pos - 1 - prefix_len))
            req.input_logprob_next_pos = max(req.input_logprob_next_pos, end)
        self.input_logprob_rows.append(lp_rows)
        self.trees.append(None)
        if prefix_len + extend_len == req.seq_len:
            self.sample_index.append(len(self.logits_rows))
            self.logits_rows.append(start_row + extend_len - 1)
        else:
            self.sample_index.append(-1)
