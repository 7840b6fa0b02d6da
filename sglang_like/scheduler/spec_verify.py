"""Accepting a verified tree: walk it through the ordinary per-token path.

At the current node (first the root) the request's state is exactly that of a plain decode
whose last token is the node's: the node's K/V are computed (this forward wrote them) and
its logits row is the target's next-token distribution. So the node is committed (its slot
enters the request's row), the sampler picks the next token from that row with every rule a
plain decode applies (grammar mask from the live matcher, penalties, min tokens,
temperature / top-p / top-k / min-p with the request's own generator), and
`OutputProcessor.append_token` takes it (grammar advance, EOS / stop / length checks, text,
jump-forward). If the token is a drafted child of the node and the request goes on
unchanged, the walk descends; otherwise that token is the bonus and the walk ends.

Hence: greedy output is the plain decode's, sampled tokens are draws from the target's own
distribution (lossless; draft probabilities never enter), a token the grammar forbids is
never accepted, and a grammar never needs rolling back (it only sees committed tokens).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_like.layers.sampler import SampleOutput, argmax_rows, select_rows
from sglang_like.speculative.tree import DraftTree

if TYPE_CHECKING:
    from sglang_like.layers.sampler import Sampler
    from sglang_like.req import FinishReason, Req
    from sglang_like.scheduler.cache_manager import KVCacheManager
    from sglang_like.scheduler.output_processor import OutputProcessor
    from sglang_like.speculative.controller import SpecController


def takes_argmax(req: Req) -> bool:
    """Whether the sampler would give this decoding request its logits row's plain argmax, and
    nothing else: greedy, and no logprobs, penalties, logit bias, grammar, or min_new_tokens
    holding EOS back (it has output, so it is decoding)."""
    sp = req.sampling_params
    return (sp.is_greedy and not req.return_logprob and not sp.has_penalties
            and not sp.token_bias and req.grammar is None and bool(req.output_ids)
            and len(req.output_ids) >= sp.min_new_tokens)


@dataclass(frozen=True)
class VerifyContext:
    """The parts of the scheduler a verify's walk uses, built by it for each verify.

    The walk writes committed nodes' slots into their requests' rows and frees the others
    (`cache`), takes tokens through `sampler` and `outputs` as a plain decode does, and
    records what it committed: with the controller, in `accept_lengths` (the scheduler's
    histogram) and one `count_token` call per token taken. A request it finishes goes to
    `end` (the scheduler's way to end a request within a step, reporting it in `touched`).
    """

    cache: KVCacheManager
    sampler: Sampler
    outputs: OutputProcessor
    controller: SpecController
    accept_lengths: collections.Counter[int]
    count_token: Callable[[], None]
    end: Callable[[Req, FinishReason, list[Req]], None]


@dataclass
class TreeWalk:
    """One request's verify in this step."""

    req: Req
    tree: DraftTree
    slots: list[int]  # KV slot of each node
    first_row: int  # the root's row in the forward's logits
    node: int = 0
    committed: list[int] = field(default_factory=list)  # nodes whose slot entered the row


def accept_trees(ctx: VerifyContext, walks: list[TreeWalk], logits: torch.Tensor,
                 touched: list[Req]) -> None:
    """Commit the longest agreeing path of every walk; free the other nodes' slots."""
    pool = ctx.cache.req_to_token_pool
    active = list(walks)
    # every request takes its row's plain argmax (`takes_argmax`): each node's token is read
    # off one argmax over the verify's rows, the sampler's own choice for them, instead of a
    # sampler call per depth (0.1-0.2 ms of a batch-1 step); on a device, where the logits
    # then stay, that is one copy of the rows' tokens
    argmax = (argmax_rows(logits) if all(takes_argmax(w.req) for w in walks) else None)
    if argmax is None and logits.device.type != "cpu":
        logits = logits.cpu()  # the host sampler walks it
    while active:
        reqs = [w.req for w in active]
        for w in active:  # the node's K/V (computed by the verify) becomes the request's
            pool.write_one(w.req.req_pool_idx, w.req.kv_len, w.slots[w.node])
            w.req.kv_len += 1
            w.committed.append(w.node)
        if argmax is not None:
            result = SampleOutput([argmax[w.first_row + w.node] for w in active],
                                  [None] * len(active), [None] * len(active))
        else:
            rows = select_rows(logits, [w.first_row + w.node for w in active])
            result = ctx.sampler.sample(rows, reqs, ctx.outputs.grammar_bitmask(reqs))
        still = []
        for j, w in enumerate(active):
            req, token = w.req, result.next_token_ids[j]
            if req.is_finished:
                continue  # its grammar failed while the mask was built: ended below
            num_out, kv_len = len(req.output_ids), req.kv_len
            ctx.count_token()
            ctx.outputs.append_token(req, token, result.logprobs[j], result.top_logprobs[j])
            if req.is_finished or req.kv_len != kv_len or len(req.output_ids) != num_out + 1 or (
                    req.output_ids[-1] != token):
                continue  # finished, or jump-forward rewrote the tail: the walk ends here
            child = w.tree.child(w.node, token)
            if child is not None:
                w.node = child
                still.append(w)
        active = still
    for w in walks:
        used = set(w.committed)
        ctx.cache.allocator.free([s for j, s in enumerate(w.slots) if j not in used])
        state = w.req.spec
        state.verify_ct += 1
        state.accepted_drafts += len(w.committed) - 1
        ctx.controller.record_verify(state, len(w.committed), w.tree, w.committed)
        ctx.accept_lengths[len(w.committed)] += 1
        if w.req.is_finished:
            ctx.end(w.req, w.req.finished_reason, touched)
        else:
            touched.append(w.req)
