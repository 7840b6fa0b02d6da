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

Every node's token can also be chosen before the walk, in one pass over the verify's rows,
where that choice does not depend on the walk: a greedy request's plain argmax
(`takes_argmax`), and with the device sampler any request it draws ahead (`draws_ahead`):
its draw at output index n is a function of (seed, n), and what the request has output when
the walk reaches a node is known (its tokens, then the node's path), so the node gets the
token the node-by-node walk would sample there. The walk then descends through those tokens
as through sampled ones, and the logits stay on the device: one copy of the nodes' tokens
comes back. A grammar's mask needs its matcher advanced along the path: such a request walks
node by node, sampled by the device sampler where the logits are (one copy of its token per
depth, which its matcher takes before the next mask). DRY / XTC are the host sampler's: those
requests walk node by node on a host copy of their own rows.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_like.layers.device_sampler import DeviceSampler
from sglang_like.layers.sampler import SampleOutput, argmax_rows, select_rows
from sglang_like.speculative.tree import DraftTree

if TYPE_CHECKING:
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


def draws_ahead(req: Req) -> bool:
    """Whether the device sampler can draw every node of this request's tree before the walk
    (`DeviceSampler.sample_ahead`): no grammar (its mask at a node needs the matcher
    advanced along the node's path) and nothing it leaves to the host sampler (DRY, XTC)."""
    return req.grammar is None and DeviceSampler.supports([req])


@dataclass(frozen=True)
class VerifyContext:
    """The parts of the scheduler a verify's walk uses, built by it for each verify.

    The walk writes committed nodes' slots into their requests' rows and frees the others
    (`cache`), takes tokens as a plain decode does (`sample`: rows [len(reqs), V] -> the
    scheduler's choice for them, device or host sampler; or drawn ahead by `device_sampler`,
    None when device sampling is off) through `outputs`, and records what it committed: with
    the controller, in `accept_lengths` (the scheduler's histogram) and one `count_token` call
    per token taken. A request it finishes goes to `end` (the scheduler's way to end a
    request within a step, reporting it in `touched`).
    """

    cache: KVCacheManager
    sample: Callable[[torch.Tensor, list[Req]], SampleOutput]
    device_sampler: DeviceSampler | None
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
    first_row: int  # the root's row in the logits it is walked on (the forward's, or a copy's)
    node: int = 0
    committed: list[int] = field(default_factory=list)  # nodes whose slot entered the row
    # every node's token (with its logprobs), chosen before the walk; None: sampled at each
    # node as the walk reaches it
    drawn: SampleOutput | None = None


def accept_trees(ctx: VerifyContext, walks: list[TreeWalk], logits: torch.Tensor,
                 touched: list[Req]) -> None:
    """Commit the longest agreeing path of every walk; free the other nodes' slots."""
    if all(takes_argmax(w.req) for w in walks):
        # one argmax over the verify's rows, the sampler's own choice for them, instead of a
        # sampler call per depth (0.1-0.2 ms of a batch-1 step)
        _take_argmax(walks, logits)
    elif ctx.device_sampler is not None:
        _draw_ahead(ctx.device_sampler, [w for w in walks if draws_ahead(w.req)], logits)
    for w in walks:
        if w.drawn is not None:
            _walk_drawn(ctx, w, w.drawn)
    # the rest node by node: grammars with the device sampler at each depth, where the logits
    # are; DRY / XTC (or all, device sampling off) with the host sampler
    by_node = [w for w in walks if w.drawn is None]
    is_on_device = [ctx.device_sampler is not None and DeviceSampler.supports([w.req])
                    for w in by_node]
    on_host = [w for w, on in zip(by_node, is_on_device, strict=True) if not on]
    _walk_by_node(ctx, [w for w, on in zip(by_node, is_on_device, strict=True) if on], logits)
    if on_host and logits.device.type != "cpu":
        logits = _rows_to_host(on_host, logits)
    _walk_by_node(ctx, on_host, logits)
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


def _take_argmax(walks: list[TreeWalk], logits: torch.Tensor) -> None:
    """Every node's token, its row's argmax (on a device, one copy of the rows' tokens)."""
    argmax = argmax_rows(logits)
    for w in walks:
        n = w.tree.num_nodes
        w.drawn = SampleOutput(argmax[w.first_row : w.first_row + n], [None] * n, [None] * n)


def _draw_ahead(sampler: DeviceSampler, walks: list[TreeWalk], logits: torch.Tensor) -> None:
    """Every node's token of `walks` drawn at once where the logits are, one copy back: a node
    is drawn as its request would draw it once the node's path is output."""
    if not walks:
        return
    index: list[int] = []
    owners: list[int] = []
    paths: list[list[int]] = []
    for k, w in enumerate(walks):
        n = w.tree.num_nodes
        index += range(w.first_row, w.first_row + n)
        owners += [k] * n
        paths += w.tree.paths()
    out = sampler.sample_ahead(select_rows(logits, index), [w.req for w in walks], owners,
                               paths)
    start = 0
    for w in walks:
        end = start + w.tree.num_nodes
        w.drawn = SampleOutput(out.next_token_ids[start:end], out.logprobs[start:end],
                               out.top_logprobs[start:end])
        start = end


def _rows_to_host(walks: list[TreeWalk], logits: torch.Tensor) -> torch.Tensor:
    """The walks' rows of `logits`, in one copy to the host (each walk's `first_row` moved to
    its rows there): the rows the host sampler's walk reads, not the whole verify's."""
    index: list[int] = []
    for w in walks:
        start = len(index)
        index += range(w.first_row, w.first_row + w.tree.num_nodes)
        w.first_row = start
    return select_rows(logits, index).cpu()


def _walk_drawn(ctx: VerifyContext, w: TreeWalk, drawn: SampleOutput) -> None:
    """Descend through the tokens drawn for the nodes until one is not a drafted child."""
    while True:
        _commit(ctx, w)
        j = w.node
        if not _take(ctx, w, drawn.next_token_ids[j], drawn.logprobs[j],
                     drawn.top_logprobs[j]):
            return


def _walk_by_node(ctx: VerifyContext, walks: list[TreeWalk], logits: torch.Tensor) -> None:
    """Descend depth by depth, one sampler call over the nodes the walks stand at."""
    active = list(walks)
    while active:
        for w in active:
            _commit(ctx, w)
        rows = select_rows(logits, [w.first_row + w.node for w in active])
        result = ctx.sample(rows, [w.req for w in active])
        active = [w for j, w in enumerate(active)
                  if _take(ctx, w, result.next_token_ids[j], result.logprobs[j],
                           result.top_logprobs[j])]


def _commit(ctx: VerifyContext, w: TreeWalk) -> None:
    """The node's K/V (computed by the verify) becomes the request's."""
    ctx.cache.req_to_token_pool.write_one(w.req.req_pool_idx, w.req.kv_len, w.slots[w.node])
    w.req.kv_len += 1
    w.committed.append(w.node)


def _take(ctx: VerifyContext, w: TreeWalk, token: int, logprob: float | None,
          top: list[tuple[float, int]] | None) -> bool:
    """The walk's node chose `token`: taken as a plain decode's; whether the walk goes on (to
    the child drafted as `token`)."""
    req = w.req
    if req.is_finished:
        return False  # its grammar failed while the mask was built: ended by the caller
    num_out, kv_len = len(req.output_ids), req.kv_len
    ctx.count_token()
    ctx.outputs.append_token(req, token, logprob, top)
    if req.is_finished or req.kv_len != kv_len or len(req.output_ids) != num_out + 1 or (
            req.output_ids[-1] != token):
        return False  # finished, or jump-forward rewrote the tail: the walk ends here
    child = w.tree.child(w.node, token)
    if child is None:
        return False
    w.node = child
    return True
