"""A step's draft trees: every drafter drafts, then the controller keeps what pays."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_like.req import Req
    from sglang_like.scheduler.plugins import Drafter
    from sglang_like.speculative.context import DraftContext
    from sglang_like.speculative.tree import DraftTree


def propose_trees(drafter: Drafter, ctx: DraftContext, decoders: list[Req], context_len: int
                  ) -> dict[int, DraftTree]:
    """Draft trees for this step's decoders (by id of the Req); {} when there are none or the
    controller expects drafting not to pay (whether the pool has room for the trees is the
    caller's to check, after the drafting). Every drafter drafts
    first and the controller then keeps what is expected to pay: a cheap drafter's (NGRAM)
    trees cut by the depth rates measured for their evidence (`choose_trees`); a confident
    drafter's (EAGLE) nodes one by one, by the head's calibrated probabilities
    (`choose_nodes`): both keep the most likely nodes, as many as pay their rows."""
    if not decoders:
        return {}
    ctl = ctx.controller
    if ctl.plain_step_stale(len(decoders)):
        return {}
    cheap = getattr(drafter, "drafts_cheaply", False)
    if cheap and ctl.rows_never_pay(len(decoders)):
        return {}
    # a confident drafter with a cheap one grafted on (EAGLE's NGRAM branch) drafts its
    # cheap trees for the requests its head is paused for too (the pause is the head's),
    # idling as a cheap drafter does (`cheap_idles`)
    copies = (not cheap and getattr(drafter, "copier", None) is not None
              and not ctl.cheap_idles(len(decoders)))
    eligible, depths, heads = [], [], set()
    for req in decoders:
        depth = min(req.sampling_params.max_new_tokens - len(req.output_ids),
                    context_len - req.seq_len) - 1
        if req.is_decoding and depth >= 1:
            head = ctl.may_draft(req.spec)
            if head or copies:
                eligible.append(req)
                depths.append(depth)
                if head:
                    heads.add(id(req))
    if not eligible:
        return {}
    if cheap:
        if ctl.cheap_idles(len(decoders)):
            return {}
        drafted = drafter.propose(eligible, depths, ctx)
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        counts = ctl.choose_trees(len(decoders), [t for _, t in pairs],
                                  [r.spec for r, _ in pairs])
        trees = {id(r): t.first(n) for (r, t), n in zip(pairs, counts, strict=True) if n > 1}
        ctl.cheap_idle_steps = 0 if trees else ctl.cheap_idle_steps + 1
    else:
        if ctl.rows_never_pay(len(decoders)):
            # no tree can pay at this size: no draft steps, and the requests are held (the
            # head stops extending over them) until the batch is asked again
            for req in eligible:
                ctl.hold(req.spec)
            return {}
        # `heads`: which requests' heads draft; the copies are drafted for all of them
        drafted = drafter.propose(eligible, depths, ctx, **({"heads": heads} if copies else {}))
        pairs = [(r, t) for r, t in zip(eligible, drafted, strict=True) if t is not None]
        if pairs:
            ctl.drafted_step = ctl.step  # this step's drafting is worth measuring
        counts, pays = ctl.choose_nodes(len(decoders), [t for _, t in pairs])
        trees = {}
        kept_copies = False
        for (req, tree), n in zip(pairs, counts, strict=True):
            # its drafting is spent: verify what is worth its rows, but pause a request
            # whose drafting keeps not paying for itself
            if id(req) in heads:
                ctl.record_drafted(req.spec, n > 1 and pays, pays)
            if n > 1:
                trees[id(req)] = tree.first(n)
                kept_copies = kept_copies or any(trees[id(req)].copied or ())
        if copies:
            ctl.cheap_idle_steps = 0 if kept_copies else ctl.cheap_idle_steps + 1
    return trees
