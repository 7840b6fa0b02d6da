"""EAGLE-3 drafting: a one-layer head over the target's features proposes a token tree.

Positions. A request with seq_len n has target K/V for positions [0, n - 1) (its last token,
the root, is the next forward's input). The head's K/V at position p is computed from the
token at p + 1 and the target's features at p, so after each target forward the drafter runs
the head over the positions that forward committed (`after_forward`); the output at the last
one predicts the token after the root: the depth-1 candidates. A node at depth d sits at
draft position n - 2 + d, its input being its token and the head's output at its parent.

KV. The head's K/V live in their own one-layer pool addressed by the same slot ids as the
target's, so a radix hit hands the draft its prefix too (only committed tokens are ever
written there by an extend). Draft steps write their nodes' K/V into scratch slots that are
allocated and freed within `propose`.

Copies. Unless turned off (`--disable-speculative-eagle-ngram-branch`), each request's tree
also gets NGRAM's continuation of its text (its own, or a recent request's) as a branch,
priced by what such continuations committed (`tree.with_copies`): where a request copies
(extraction, editing) a copied span's tokens after its first are what a one-layer head
guesses worst and a lookup best. The head runs over whatever the verify commits, so it
drafts on from a copied span as from its own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import sglang_like.layers.native_decode as native
import sglang_like_kernels
from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.attention import attend
from sglang_like.layers.quantization.int8 import Int8EmbeddingMethod
from sglang_like.layers.rotary import RotaryEmbedding
from sglang_like.mem_pool import KVPool
from sglang_like.speculative.eagle1_head import Eagle1Head
from sglang_like.speculative.eagle_head import Eagle3Head
from sglang_like.speculative.eagle_native import NativeEagleHead
from sglang_like.speculative.head_loader import load_draft_head
from sglang_like.speculative.ngram import NgramDrafter
from sglang_like.speculative.tree import DraftTree, with_copies
from sglang_like.utils.upload import Packer, upload_ints

if TYPE_CHECKING:
    from sglang_like.model_runner import ModelRunner
    from sglang_like.req import Req
    from sglang_like.schedule_batch import ScheduleBatch
    from sglang_like.speculative import SpecConfig
    from sglang_like.speculative.context import DraftContext

logger = logging.getLogger(__name__)

# Target features a request keeps while its drafting is paused or held, in bf16 (the head's
# int linears round its input to 8-bit blocks anyway): 3.5 kB a row, at most 3.5 MB a request.
# A batch too large to draft in holds its requests from their prefill on, prompt rows
# included; past this many rows those kept are dropped (keeping starts again at the next
# step) and the head's K/V keep a hole there (its drafts then miss more often; outputs never
# change).
_MAX_PENDING = 1024

# the deepest a grafted NGRAM branch goes (NGRAM's own default: 5 drafts)
_COPY_DEPTH = 5
# a request whose grafted branch's first draft is priced at least this sure skips the head's
# draft steps (it keeps the head's next-token candidates, which its extend drafted)
_COPY_SURE = 0.6


def _head_rows(fb: ForwardBatch) -> native.AttnRows:
    """The key rows of a head forward: a draft step's under its masks, an extend over the
    committed positions otherwise."""
    return native.masked_rows(fb) if fb.custom_masks is not None else native.extend_rows(fb)


@dataclass
class EagleState:
    """What the head's last extend left for the next tree: candidates for the token after
    the root (target ids, log-probs) and the output feature they came from."""

    cand_ids: list[int]
    cand_logprobs: list[float]
    hidden: torch.Tensor  # [H]
    position: int  # draft position of that output (= kv_len - 1 when fresh)


@dataclass
class _Pending:
    """Target features of a request's committed positions [first, first + num_rows) that the
    head has not run over yet (its drafting is paused), one chunk per forward."""

    first: int
    chunks: list[torch.Tensor]
    num_rows: int


@dataclass
class _Node:
    token: int
    parent: int  # index into the request's node list; -1: the root
    score: float
    feature: torch.Tensor | None  # the head output that predicted it (its input feature)
    slot: int = 0  # scratch slot once forwarded


class EagleDrafter:
    """EAGLE / EAGLE-3 drafting as the scheduler drives a drafter (`scheduler.plugins.Drafter`):
    `propose` before a step's batch forms, `after_forward` after its forward. It owns the
    head, its KV pool and each request's `spec.eagle` / `spec.eagle_pending`; the runner is
    its own (it reads the target's features and the req_to_token rows)."""

    def __init__(self, spec: SpecConfig, runner: ModelRunner) -> None:
        self.spec = spec
        self.num_draft_tokens = spec.num_draft_tokens
        self.runner = runner
        self.head: Eagle3Head | Eagle1Head = load_draft_head(spec.draft_model_path,
                                                             runner.device)
        hc, tc = self.head.config, runner.model_config
        if hc.vocab_size != tc.vocab_size or hc.target_hidden_size != tc.hidden_size:
            raise ValueError(
                f"draft head {spec.draft_model_path!r} was trained for a target with vocab "
                f"{hc.vocab_size} and hidden {hc.target_hidden_size}; this model has "
                f"{tc.vocab_size} and {tc.hidden_size}")
        if isinstance(self.head, Eagle1Head):
            # EAGLE-1/2 reads the target's last hidden state after its norm (the capture id
            # one past the last layer) and the target's LM head
            aux: tuple[int, ...] = (tc.num_hidden_layers,)
            self.head.target_lm_head = runner.model.lm_head
        else:
            aux = tuple(hc.aux_layer_ids) or runner.model.default_aux_layers()
            if len(aux) != 3 or not all(0 <= i < tc.num_hidden_layers for i in aux):
                raise ValueError(
                    f"draft head {spec.draft_model_path!r}: eagle_aux_hidden_state_layer_ids "
                    f"{list(aux)} (as layer inputs) are not three layers of this "
                    f"{tc.num_hidden_layers}-layer target")
        runner.aux_layers = aux
        # off the CPU the head runs in the model's dtype (its LM head alone reads
        # draft_vocab x hidden weights a forward: half the bytes in bf16), its KV too; on it
        # in float32, which the native head packs from
        self.dtype = head_dtype(runner.dtype, runner.device)
        self.head.to(self.dtype)
        self.pool = KVPool(runner.kv_pool.num_slots, 1, hc.num_key_value_heads, hc.head_dim,
                           self.dtype, runner.device)
        context = runner.req_to_token_pool.req_to_token.shape[1]
        self.rope = RotaryEmbedding(hc.head_dim, context + 1, hc.rope_theta, hc.rope_scaling,
                                    runner.device)
        self.sm_scale = hc.head_dim ** -0.5
        self.num_forwards = 0
        self.copier = (NgramDrafter(_COPY_DEPTH + 1, spec.ngram_min_window, spec.ngram_max_window,
                                    spec.ngram_breadth, spec.ngram_capacity)
                       if spec.ngram_branch else None)
        # where the target runs natively (quantized, CPU kernels built), the head does too
        self.native = (NativeEagleHead(self.head, runner.quant, self.rope.cos_table,
                                       self.rope.sin_table)
                       if isinstance(self.head, Eagle3Head) and runner.model.native_decode
                       and runner.device.type == "cpu" else None)
        if self.native is not None:
            self.head.drop_float_weights()
        self.graphs: EagleDraftGraphs | None = None  # capture_graphs
        # the beams stay on the device between draft depths (_draft_trees_on_device) off the
        # CPU; on it, where a sync costs nothing, the host walk drafts (gpu_check's
        # --cpu-smoke turns this on to run the device path there)
        self.on_device = runner.device.type != "cpu"
        # the fused head embeds its tokens from the target's int8 rows itself
        emb = runner.model.model.embed_tokens
        self._int8_embedding = (
            isinstance(emb.method, Int8EmbeddingMethod) and emb.weight.dtype == torch.int8
            and emb.block_scale.dtype == torch.float32 and emb.weight.dim() in (2, 5)
            and emb.weight.is_contiguous() and emb.block_scale.is_contiguous()
            and emb.block_scale.shape[1 if emb.weight.dim() == 5 else -1] * 32
            == runner.model_config.hidden_size)

    def finished(self, req: Req) -> None:
        if self.copier is not None:
            self.copier.finished(req)

    def flush(self) -> None:
        if self.copier is not None:
            self.copier.flush()

    # ---- the head over the pool ----------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.runner.model.model.embed_tokens
        return emb.method.embed(emb, ids).to(self.dtype)

    @torch.inference_mode()
    def _forward(self, fb: ForwardBatch, features: torch.Tensor) -> torch.Tensor:
        """Head outputs [T, H] of fb's rows, their K/V written to the draft pool."""
        k_pool, v_pool = self.pool.k_buffers[0], self.pool.v_buffers[0]
        self.num_forwards += 1
        if self.native is not None:
            attn = _head_rows(fb)
            return self.native.forward(self._embed(fb.input_ids),
                                       self.native.project(features), fb.positions,
                                       fb.out_slots, attn, k_pool, v_pool)
        head = self.head
        hidden = head.project(features)
        q, k, v, residual = head.attention_inputs(self._embed(fb.input_ids), hidden)
        tables = self.rope.tables(fb.positions)
        q, k = tables.rotate(q), tables.rotate(k)
        sglang_like_kernels.store_kv(k_pool, v_pool, fb.out_slots, k, v)
        out = attend(q, k_pool, v_pool, fb, self.sm_scale)  # float32 (rotate's dtype)
        return head.finish(out.reshape(out.shape[0], -1).to(self.dtype), residual)

    @torch.inference_mode()
    def _run_head(self, fb: ForwardBatch, features: torch.Tensor,
                  logit_rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over fb's rows (`_forward`) and the top-k of its distribution at rows
        `logit_rows` (None: every row): (outputs [T, H], target ids [R, k], log-probs
        [R, k]). Where the head's linears are x16 int4, all of it is one native call."""
        k = self.spec.eagle_topk
        native_head = self.native
        if native_head is not None and native_head.fused_ptrs is not None:
            self.num_forwards += 1
            attn = _head_rows(fb)
            rows = (torch.arange(fb.num_tokens, dtype=torch.long) if logit_rows is None
                    else logit_rows)
            emb = self.runner.model.model.embed_tokens
            embeds = ((emb.weight, emb.block_scale, fb.input_ids) if self._int8_embedding
                      else self._embed(fb.input_ids))
            return native_head.run(embeds, features, fb.positions, fb.out_slots, attn,
                                   self.pool.k_buffers[0], self.pool.v_buffers[0], rows,
                                   self.head.d2t, k)
        outs = self._forward(fb, features)
        picked = outs if logit_rows is None else outs[logit_rows]
        logits = (native_head.logits(picked) if native_head is not None
                  else self.head.logits(picked))
        values, ids = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
        return outs, self.head.to_target_ids(ids), values

    # ---- after each target forward: extend the head over the committed positions --------
    def after_forward(self, batch: ScheduleBatch, committed: dict[int, list[int]],
                      ctx: DraftContext) -> None:
        """Run the head over the positions `batch`'s forward committed: a verified request's
        are its `committed` tree nodes (by id of the Req, in commit order), another's all of
        its rows."""
        features = self.runner.last_features
        if features is None:
            return
        table = self.runner.req_to_token_pool.req_to_token
        ctl = ctx.controller
        # a batch too large for any tree to pay (`rows_never_pay`) holds its requests when it
        # drafts (`propose_trees`); they are held here already, so that the head neither runs
        # over the prompts of new ones nor catches up when a hold ends, for drafts that will
        # not come (at batch 32 the two were 3-4% of a 96-token run). Waiting requests count:
        # they join the batch, and a batch's prompts are prefilled a few at a time.
        hold = ctl.rows_never_pay(ctx.num_requests)
        # which rows of `features` each request committed; the requests the controller does
        # not let draft next step keep theirs as pending (see below), the others run the head
        # over them now. One gather per kind: a gather a request took twice this loop's own
        # time at batch 32 (cProfile, every request paused: 4.1 against 2.0 ms a step on a
        # loaded machine, about 0.8 against 0.4 unloaded)
        drafting: list[tuple[Req, int, int, _Pending | None]] = []
        paused: list[tuple[Req, int, int, _Pending | None]] = []
        draft_rows: list[int] = []
        paused_rows: list[int] = []
        row_start = 0
        for i, req in enumerate(batch.reqs):
            n = batch.extend_lens[i]
            first = batch.prefix_lens[i]
            nodes = committed.get(id(req))  # a verify: the tree nodes it committed
            start, row_start = row_start, row_start + n
            state = req.spec
            pending, state.eagle_pending = state.eagle_pending, None
            if req.is_finished or req.req_pool_idx is None:
                state.eagle = None
                continue
            num = len(nodes) if nodes is not None else n
            count = min(num, req.kv_len - first)  # jump-forward may drop a tail
            if count <= 0:
                state.eagle = None
                continue
            rows = ([start + j for j in nodes[:count]] if nodes is not None
                    else range(start, start + count))
            if pending is not None and pending.first + pending.num_rows != first:
                pending = None  # not the positions right before these: the head skips them
            if hold:
                ctl.hold(state)
            if ctl.may_draft(state, ahead=1):
                drafting.append((req, first, count, pending))
                draft_rows += rows
            else:
                state.eagle = None
                paused.append((req, first, count, pending))
                paused_rows += rows
        if paused:
            # not drafting next step (the controller paused it): keep the features and run
            # the head over all of them at once when drafting resumes, so its K/V have no
            # holes and idle steps cost nothing (the chunks are joined then, once)
            got = features[torch.tensor(paused_rows, device=features.device)].to(
                torch.bfloat16)
            at = 0
            for req, first, count, pending in paused:
                cur, at = got[at : at + count], at + count
                if pending is None:
                    pending = _Pending(first, [], 0)
                pending.chunks.append(cur)
                pending.num_rows += count
                if pending.num_rows <= _MAX_PENDING:
                    req.spec.eagle_pending = pending
        if not drafting:
            return
        ids, pos, slots, prefix, lens = [], [], [], [], []
        for req, first, count, pending in drafting:
            if pending is not None:  # catch up: the pending positions come first
                first, count = pending.first, pending.num_rows + count
            new = req.fill_slice(first + 1, first + count + 1)
            if req.images:  # image positions' pad ids: the head embeds them as token 0
                vocab = self.runner.model_config.vocab_size
                new = [t if t < vocab else 0 for t in new]
            ids += new
            pos += range(first, first + count)
            # the pool's host copy off the CPU: no read back from the device's table
            slots += self.runner.req_to_token_pool.read(req.req_pool_idx, first, first + count)
            prefix.append(first)
            lens.append(count)
        reqs = [req for req, *_ in drafting]
        dev = self.runner.device
        # the rows to gather and the head's batch cross in one copy (a copy each before)
        rows_on_dev, *meta = upload_ints(
            [draft_rows, ids, pos, slots, [r.req_pool_idx for r in reqs], prefix, lens], dev)
        got = features[rows_on_dev]
        feats, at = [], 0
        for _, _, count, pending in drafting:
            cur, at = got[at : at + count], at + count
            if pending is not None:
                cur = torch.cat([*pending.chunks, cur.to(torch.bfloat16)]).float()
            feats.append(cur)
        fb = ForwardBatch(
            input_ids=meta[0], positions=meta[1], out_slots=meta[2], req_pool_indices=meta[3],
            prefix_lens=meta[4], extend_lens=meta[5],
            logits_indices=torch.empty(0, dtype=torch.long, device=dev),
            req_to_token=table, is_decode=all(n == 1 for n in lens),
            max_extend_len=max(lens, default=0),
        )
        last = torch.tensor(lens).cumsum(0) - 1
        outs, cand_ids, cand_lp = self._run_head(fb, torch.cat(feats), last)
        last_outs = outs[last]
        ids_rows, lp_rows = _candidates_to_host(cand_ids, cand_lp)
        for j, req in enumerate(reqs):
            if req.kv_len != prefix[j] + lens[j]:
                req.spec.eagle = None  # a prefill chunk: more prompt follows, no candidates
                continue
            req.spec.eagle = EagleState(ids_rows[j], lp_rows[j], last_outs[j], req.kv_len - 1)

    # ---- a tree per request ---------------------------------------------------------------
    def propose(self, reqs: list[Req], max_depths: list[int], ctx: DraftContext,
                heads: set[int] | None = None) -> list[DraftTree | None]:
        """A tree per request: the head's (for those in `heads`, by id; None: all) with, when
        `heads` is given, NGRAM's continuation grafted on (`with_copies`)."""
        trees: list[DraftTree | None] = [None] * len(reqs)
        live = [i for i, r in enumerate(reqs)
                if r.spec.eagle is not None and r.spec.eagle.position == r.kv_len - 1
                and (heads is None or id(r) in heads)]
        copied: dict[int, tuple[DraftTree, list[float]]] = {}
        if self.copier is not None and heads is not None:
            ctl = ctx.controller
            for i, req in enumerate(reqs):
                copies = self.copier.propose_one(req, min(_COPY_DEPTH, max_depths[i]))
                if copies is not None:
                    copied[i] = copies, ctl.copy_node_probs(copies, req.spec)
        if live:
            # a request copying surely gets the head's next-token candidates (drafted by
            # its extend) without the head's draft steps beyond them
            sure = {i for i in live if i in copied and copied[i][1][1] >= _COPY_SURE}
            k = self.spec.eagle_topk
            on_device = (self.on_device
                         and all(len(reqs[i].spec.eagle.cand_ids) == k for i in live))
            draft = self._draft_trees_on_device if on_device else self._draft_trees
            draft(reqs, max_depths, ctx, live, trees, sure)
        if copied:
            calibration = ctx.controller.draft_calibration
            for i, (copies, probs) in copied.items():
                trees[i] = with_copies(trees[i], copies, probs, calibration)
        return trees

    def _draft_trees(self, reqs: list[Req], max_depths: list[int], ctx: DraftContext,
                     live: list[int], trees: list[DraftTree | None],
                     shallow: set[int] = frozenset()) -> None:
        """The head's trees of the `live` requests (those with candidates) into `trees`;
        those in `shallow` only their next-token candidates (no draft steps)."""
        spec = self.spec
        nodes: dict[int, list[_Node]] = {}
        beams: dict[int, list[int]] = {}
        for i in live:
            st = reqs[i].spec.eagle
            nodes[i] = [_Node(t, -1, s, st.hidden) for t, s in zip(st.cand_ids, st.cand_logprobs,
                                                                  strict=True)]
            beams[i] = list(range(len(nodes[i])))
        depth_cap = {i: 1 if i in shallow else min(spec.num_steps, max_depths[i]) for i in live}
        # beams too unlikely to be verified are not drafted deeper
        min_lp = ctx.controller.min_draft_logprob()
        scratch: list[int] = []
        try:
            for depth in range(1, spec.num_steps):
                for i in live:
                    beams[i] = [b for b in beams[i] if nodes[i][b].score >= min_lp]
                step = [i for i in live if depth < depth_cap[i] and beams[i]]
                if not step:
                    break
                need = sum(len(beams[i]) for i in step)
                got = ctx.alloc_slots(need)
                if got is None:
                    break  # the pool is short: draft no deeper
                scratch += got
                self._draft_step(reqs, step, nodes, beams, got, depth)
        finally:
            ctx.free_slots(scratch)
        for i in live:
            trees[i] = self._select(reqs[i], nodes[i], min(spec.num_draft_tokens,
                                                           1 + spec.eagle_topk * depth_cap[i]),
                                    depth_cap[i])

    def _draft_trees_on_device(self, reqs: list[Req], max_depths: list[int],
                               ctx: DraftContext, live: list[int],
                               trees: list[DraftTree | None],
                               shallow: set[int] = frozenset()) -> None:
        """`_draft_trees` with the beams kept on the device from one draft step to the next,
        for a GPU: the host version reads each depth's top-k back to prune and pick the next
        beams, a sync a depth; here they come back once, every depth's at the end.

        So that each step's shapes are known on the host, a stepped request forwards exactly
        `eagle_topk` rows a depth: its beams, the best children of the last depth's (a top-k
        on the device), a beam under the controller's log-prob floor (or a child of one)
        computed but dead, parenting no node. Its attention masks (each row sees its
        ancestors), features and tokens are gathered on the device from the beams' parents.
        The trees are the host version's, nodes and order: only a tie in the top-k may pick
        another equal beam. The scores are the same Python sums of log-probs, to the float32
        rounding of the head's matmuls (the host version forwards no dead beam, and a CPU
        matmul over other rows may round otherwise). A request whose beams all died
        keeps stepping (the host version drops it); its slots count in each depth's
        scratch. With `capture_graphs`, a batch whose requests all draft every depth replays
        the captured depths (`EagleDraftGraphs`)."""
        spec, k = self.spec, self.spec.eagle_topk
        min_lp = ctx.controller.min_draft_logprob()
        depth_cap = {i: 1 if i in shallow else min(spec.num_steps, max_depths[i]) for i in live}
        # a request none of whose candidates clears the floor has no beam from the start
        stepping = [i for i in live
                    if any(lp >= min_lp for lp in reqs[i].spec.eagle.cand_logprobs)]
        scratch: list[int] = []
        try:
            graphs = self.graphs
            if (graphs is not None and stepping == live
                    and all(depth_cap[i] == spec.num_steps for i in live)
                    and len(live) <= graphs.buckets[-1]):
                scratch = ctx.alloc_slots(len(live) * k * (spec.num_steps - 1)) or []
            if scratch:
                records = graphs.run([reqs[i] for i in live], scratch, min_lp)
                records = [(live, *r) for r in records]
            else:
                records = self._draft_depths(reqs, stepping, depth_cap, ctx, scratch, min_lp)
        finally:
            ctx.free_slots(scratch)
        host = _records_to_host(records)
        for i in live:
            st = reqs[i].spec.eagle
            ns = [_Node(t, -1, s, None) for t, s in zip(st.cand_ids, st.cand_logprobs,
                                                        strict=True)]
            beams = list(range(len(ns)))  # the node of each beam slot; -1: a dead one
            for (step_i, ids, lps, pick) in host:
                if i not in step_i:
                    break
                r = step_i.index(i)
                child = {}
                for b, j in enumerate(beams):
                    if j < 0 or ns[j].score < min_lp:
                        continue
                    for c in range(k):
                        ns.append(_Node(ids[r][b][c], j, ns[j].score + lps[r][b][c], None))
                        child[b * k + c] = len(ns) - 1
                beams = [child.get(p, -1) for p in pick[r]]
            trees[i] = self._select(reqs[i], ns, min(spec.num_draft_tokens,
                                                     1 + k * depth_cap[i]), depth_cap[i])

    def _draft_depths(self, reqs: list[Req], stepping: list[int], depth_cap: dict[int, int],
                      ctx: DraftContext, scratch: list[int], min_lp: float
                      ) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The draft depths of `stepping` requests, each while under its depth cap, eagerly;
        the slots each takes appended to `scratch`. Per depth: (its requests, children's ids,
        log-probs, picks), on the device."""
        k, dev = self.spec.eagle_topk, self.runner.device
        table = self.runner.req_to_token_pool
        records: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        step: list[int] = []
        for depth in range(1, self.spec.num_steps):
            prev, step = step, [i for i in stepping if depth < depth_cap[i]]
            if not step:
                break
            n = len(step)
            got = ctx.alloc_slots(n * k)
            if got is None:
                break  # the pool is short: draft no deeper
            scratch += got
            for r, i in enumerate(step):  # the rows' slots after the forwarded ones
                req = reqs[i]
                table.write(req.req_pool_idx, req.kv_len + (depth - 1) * k,
                            got[r * k:(r + 1) * k])
            packer = Packer()  # the step's host data: one copy
            for part in ([reqs[i].kv_len - 1 + depth for i in step for _ in range(k)], got,
                         [reqs[i].req_pool_idx for i in step], [reqs[i].kv_len for i in step]):
                packer.add(part)
            if depth == 1:
                packer.add([t for i in step for t in reqs[i].spec.eagle.cand_ids])
                packer.add([lp for i in step for lp in reqs[i].spec.eagle.cand_logprobs],
                           is_float=True)
            elif len(step) < len(prev):  # the requests at their depth cap leave
                packer.add([prev.index(i) for i in step])
            meta = packer.to(dev)
            if depth == 1:
                beams = _Beams.first(meta[4].view(n, k), meta[5].view(torch.float64).view(n, k),
                                     torch.stack([reqs[i].spec.eagle.hidden for i in step]))
            elif len(step) < len(prev):
                beams = beams.subset(meta[4])
            rec, beams = self._depth_on_device(beams, meta[0], meta[1], meta[2], meta[3],
                                               min_lp)
            records.append((step, *rec))
        return records

    def _depth_on_device(self, beams: _Beams, positions: torch.Tensor, out_slots: torch.Tensor,
                         req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         min_lp: float | torch.Tensor, mask_meta: torch.Tensor | None = None
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], _Beams]:
        """One draft depth of n requests' k beams each on the device, reading nothing back
        (rows request-major; their slots already in the table after the forwarded ones):
        ((children's ids [n, k, k], log-probs [n, k, k], picks [n, k]), the next beams)."""
        n, k = beams.tokens.shape
        dev = beams.tokens.device
        fb = ForwardBatch(
            input_ids=beams.tokens.reshape(-1), positions=positions, out_slots=out_slots,
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
            extend_lens=torch.full((n,), k, dtype=torch.long, device=dev),
            logits_indices=torch.empty(0, dtype=torch.long, device=dev),
            req_to_token=self.runner.req_to_token_pool.req_to_token,
            custom_masks=list(beams.masks), max_extend_len=k, custom_mask_meta=mask_meta)
        outs, cand_ids, cand_lp = self._run_head(fb, beams.feats, None)
        cand_ids, cand_lp = cand_ids.view(n, k, k), cand_lp.view(n, k, k)
        pick, tokens, scores, alive = _next_beams(beams.scores, beams.alive, cand_ids, cand_lp,
                                                  min_lp)
        parent = pick // k
        feats = outs.view(n, k, -1).gather(
            1, parent.unsqueeze(-1).expand(n, k, outs.shape[-1])).view(n * k, -1)
        masks = torch.cat([beams.masks.gather(1, parent.unsqueeze(-1).expand(
            n, k, beams.masks.shape[-1])), _eye(n, k, dev)], dim=2)
        return (cand_ids, cand_lp, pick), _Beams(tokens, scores, alive, feats, masks)

    @torch.inference_mode()
    def capture_graphs(self, max_batch_size: int, backend: Any = None) -> None:
        """Capture the draft depths (`--speculative-num-steps` - 1 of them, each request
        forwarding `eagle_topk` beams) as CUDA graphs for batches of up to `max_batch_size`
        requests (`EagleDraftGraphs`); `backend`: the graph API (default: CUDA's)."""
        from sglang_like.model_executor.cuda_graph import CudaGraphs

        if self.native is not None:
            raise ValueError("the native CPU head has no CUDA graphs")
        self.graphs = EagleDraftGraphs(self, max_batch_size,
                                       backend if backend is not None else CudaGraphs())

    def _draft_step(self, reqs: list[Req], step: list[int], nodes: dict[int, list[_Node]],
                    beams: dict[int, list[int]], slots: list[int], depth: int) -> None:
        """Run the head on each request's current beams (depth `depth`) and expand them."""
        pool = self.runner.req_to_token_pool
        k = self.spec.eagle_topk
        ids, pos, feats, out_slots, masks = [], [], [], [], []
        taken = 0
        for i in step:
            req, ns = reqs[i], nodes[i]
            for b in beams[i]:
                ns[b].slot = slots[taken]
                taken += 1
            # every forwarded node so far, in forward order, after the committed prefix
            done = [j for j, nd in enumerate(ns) if nd.slot]
            base = req.kv_len
            # through the pool: off the CPU every request's nodes cross in one copy
            pool.write(req.req_pool_idx, base, [ns[j].slot for j in done])
            col = {j: c for c, j in enumerate(done)}
            mask = torch.zeros(len(beams[i]), len(done), dtype=torch.bool)
            for r, b in enumerate(beams[i]):
                j = b
                while j >= 0:
                    mask[r, col[j]] = True
                    j = ns[j].parent
                ids.append(ns[b].token)
                pos.append(base - 1 + depth)
                feats.append(ns[b].feature)
                out_slots.append(ns[b].slot)
            masks.append(mask)
        dev = self.runner.device
        meta = upload_ints([ids, pos, out_slots, [reqs[i].req_pool_idx for i in step],
                            [reqs[i].kv_len for i in step], [len(beams[i]) for i in step]], dev)
        fb = ForwardBatch(
            input_ids=meta[0], positions=meta[1], out_slots=meta[2], req_pool_indices=meta[3],
            prefix_lens=meta[4], extend_lens=meta[5],
            logits_indices=torch.empty(0, dtype=torch.long, device=dev),
            req_to_token=pool.req_to_token, custom_masks=masks,
        )
        outs, cand_ids, cand_lp = self._run_head(fb, torch.stack(feats), None)
        cand_ids, cand_lp = _candidates_to_host(cand_ids, cand_lp)
        r = 0
        for i in step:
            ns = nodes[i]
            children = []
            for b in beams[i]:
                for t, lp in zip(cand_ids[r], cand_lp[r], strict=True):
                    ns.append(_Node(t, b, ns[b].score + lp, outs[r]))
                    children.append(len(ns) - 1)
                r += 1
            children.sort(key=lambda j: -ns[j].score)
            beams[i] = children[:k]

    @staticmethod
    def _select(req: Req, ns: list[_Node], num_nodes: int, max_depth: int) -> DraftTree:
        """The root and the best num_nodes - 1 candidates whose parents are in too, most
        likely first, with their probabilities."""
        depth = []
        for nd in ns:
            depth.append(1 if nd.parent < 0 else depth[nd.parent] + 1)
        order = sorted(range(len(ns)), key=lambda j: (-ns[j].score, depth[j]))
        picked: dict[int, int] = {}  # candidate -> tree index
        tokens, parents = [req.output_ids[-1] if req.output_ids else req.fill_ids[-1]], [-1]
        probs = [1.0]
        for j in order:
            if len(tokens) >= num_nodes:
                break
            if depth[j] > max_depth:
                continue
            p = ns[j].parent
            if p >= 0 and p not in picked:
                continue
            picked[j] = len(tokens)
            tokens.append(ns[j].token)
            parents.append(0 if p < 0 else picked[p])
            probs.append(math.exp(ns[j].score))
        return DraftTree(tokens, parents, probs=probs)


@dataclass
class _Beams:
    """n requests' k beams each on the device, at one draft depth: tokens [n, k], scores
    [n, k] float64, alive [n, k] bool, input features [n * k, H] (the head's output at each
    beam's parent; the candidates': the output they came from), masks [n, k, C] over the
    C rows forwarded so far (each beam's ancestors, itself last)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    alive: torch.Tensor
    feats: torch.Tensor
    masks: torch.Tensor

    @staticmethod
    def first(tokens: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor) -> _Beams:
        """Depth 1: each request's candidates (`hidden` [n, H]: the output they came from)."""
        n, k = tokens.shape
        return _Beams(tokens, scores, torch.ones(n, k, dtype=torch.bool, device=tokens.device),
                      hidden.repeat_interleave(k, dim=0), _eye(n, k, tokens.device))

    def subset(self, rows: torch.Tensor) -> _Beams:
        """The beams of requests `rows` (an index on the device)."""
        n, k = self.tokens.shape
        return _Beams(self.tokens[rows], self.scores[rows], self.alive[rows],
                      self.feats.view(n, k, -1)[rows].reshape(len(rows) * k, -1),
                      self.masks[rows])


def _eye(n: int, k: int, device: torch.device) -> torch.Tensor:
    """n identity masks [n, k, k] (a beam sees itself)."""
    return torch.eye(k, dtype=torch.bool, device=device).expand(n, k, k)


class EagleDraftGraphs:
    """`EagleDrafter`'s draft depths as CUDA graphs, one per bucket of requests
    (`graph_buckets`), all depths of a bucket in one graph: every request forwards
    `eagle_topk` beams at each of the `num_steps - 1` depths, so every shape is the bucket's.
    Inputs live in fixed buffers (the candidates, their scores and features, each depth's
    slots, the requests' table rows and lengths, the floor); a padding request reads row 0
    of the table with no prefix and writes its K/V to the padding slot 0. The masks'
    offsets are on the device from the capture on (`masked_offsets`). The output: every
    depth's (ids, log-probs, picks) in one float64 buffer, copied to the host once."""

    def __init__(self, drafter: EagleDrafter, max_batch_size: int, backend: Any) -> None:
        from sglang_like.model_executor.cuda_graph import graph_buckets
        from sglang_like_kernels.triton_ops import masked_offsets

        self.drafter = drafter
        self.k = k = drafter.spec.eagle_topk
        self.depths = depths = drafter.spec.num_steps - 1
        if depths < 1:
            raise ValueError("EAGLE's draft graphs need --speculative-num-steps of at least 2")
        self.buckets = graph_buckets(max_batch_size)
        reqs, dev = self.buckets[-1], drafter.runner.device
        hidden = drafter.head.config.hidden_size
        self.tokens = torch.zeros(reqs, k, dtype=torch.long, device=dev)
        self.scores = torch.zeros(reqs, k, dtype=torch.float64, device=dev)
        self.hidden = torch.zeros(reqs, hidden, dtype=drafter.dtype, device=dev)
        self.slots = torch.zeros(depths, reqs * k, dtype=torch.long, device=dev)
        self.req_pool_indices = torch.zeros(reqs, dtype=torch.long, device=dev)
        self.kv_lens = torch.zeros(reqs, dtype=torch.long, device=dev)
        self.min_lp = torch.zeros((), dtype=torch.float64, device=dev)
        # every (bucket, depth)'s mask offsets, views of one copy
        keys = [(bs, d) for bs in self.buckets for d in range(1, depths + 1)]
        host = [masked_offsets([k] * bs, [d * k] * bs, torch.device("cpu")) for bs, d in keys]
        self._mask_meta = dict(zip(keys, torch.cat(host).to(dev).split(
            [len(h) for h in host]), strict=True))
        self._table = drafter.runner.req_to_token_pool.req_to_token
        self._replay: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        for bs in reversed(self.buckets):
            self._replay[bs], (self._outputs[bs], _) = backend.capture(
                lambda bs=bs: (self._depths(bs), None))
        logger.info("CUDA graphs captured for EAGLE's %d draft depths of %s requests", depths,
                    ", ".join(map(str, self.buckets)))

    def _depths(self, bs: int) -> torch.Tensor:
        k = self.k
        kv = self.kv_lens[:bs]
        beams = _Beams.first(self.tokens[:bs], self.scores[:bs], self.hidden[:bs])
        parts = []
        for d in range(1, self.depths + 1):
            positions = (kv - 1 + d).repeat_interleave(k)
            rec, beams = self.drafter._depth_on_device(
                beams, positions, self.slots[d - 1, :bs * k], self.req_pool_indices[:bs], kv,
                self.min_lp, self._mask_meta[(bs, d)])
            parts += [t.reshape(-1).to(torch.float64) for t in rec]
        return torch.cat(parts)

    @torch.inference_mode()  # the buffers are inference tensors (captured in that mode)
    def run(self, reqs: list[Req], slots: list[int], min_lp: float
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The draft depths of `reqs` (each with k candidates; `slots`: depths x requests x k
        scratch slots, depth-major) by the smallest bucket's replay: per depth (ids [n, k, k],
        log-probs, picks [n, k]) as float64 views of one buffer."""
        k, n, drafter = self.k, len(reqs), self.drafter
        bs = next(b for b in self.buckets if b >= n)
        table = drafter.runner.req_to_token_pool
        per = n * k
        for d in range(self.depths):
            for r, req in enumerate(reqs):
                table.write(req.req_pool_idx, req.kv_len + d * k,
                            slots[d * per + r * k:d * per + (r + 1) * k])
        packer = Packer()
        packer.add([t for req in reqs for t in req.spec.eagle.cand_ids])
        packer.add([lp for req in reqs for lp in req.spec.eagle.cand_logprobs], is_float=True)
        packer.add(slots)
        packer.add([req.req_pool_idx for req in reqs])
        packer.add([req.kv_len for req in reqs])
        packer.add([min_lp], is_float=True)
        ids, lps, got, rows, kv, floor = packer.to(drafter.runner.device)
        self.tokens[:n].copy_(ids.view(n, k))
        self.scores[:n].copy_(lps.view(torch.float64).view(n, k))
        self.slots[:, :per].copy_(got.view(self.depths, per))
        self.req_pool_indices[:n].copy_(rows)
        self.kv_lens[:n].copy_(kv)
        self.min_lp.copy_(floor.view(torch.float64)[0])
        self.hidden[:n].copy_(torch.stack([req.spec.eagle.hidden for req in reqs]))
        if bs > n:  # padding: row 0, no prefix, K/V into slot 0 (its beams' scores -inf)
            self.tokens[n:bs].zero_()
            self.scores[n:bs].fill_(-math.inf)
            self.slots[:, per:bs * k].zero_()
            self.req_pool_indices[n:bs].zero_()
            self.kv_lens[n:bs].zero_()
        table_now = table.req_to_token  # the property uploads the rows' pending writes
        assert table_now is self._table  # the tensor the capture read
        self._replay[bs]()
        self.num_replays += 1
        drafter.num_forwards += self.depths
        parts = self._outputs[bs].split([bs * k * k, bs * k * k, bs * k] * self.depths)
        return [(ids.view(bs, k, k)[:n], lps.view(bs, k, k)[:n], pick.view(bs, k)[:n])
                for ids, lps, pick in zip(parts[0::3], parts[1::3], parts[2::3], strict=True)]


def head_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The draft head's dtype (weights and KV): the model's off the CPU, float32 on it."""
    return torch.float32 if device.type == "cpu" else model_dtype


def _next_beams(scores: torch.Tensor, alive: torch.Tensor, cand_ids: torch.Tensor,
                cand_lp: torch.Tensor, min_lp: float | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft depth's beam choice on the device, for n requests of k beams each: beams
    [n, k] (scores float64, alive), their children's target ids and log-probs [n, k, k].
    The children of the beams alive and at or above the floor live; the best k of every
    request's children (live ones first) are the next beams: (picks [n, k], child index
    b * k + c, best first; their tokens, scores, alive)."""
    n, k = scores.shape
    passing = alive & (scores >= min_lp)
    child_scores = (scores.unsqueeze(-1) + cand_lp.double()).view(n, k * k)
    child_alive = passing.unsqueeze(-1).expand(n, k, k).reshape(n, k * k)
    pick = torch.where(child_alive, child_scores, -math.inf).topk(k, dim=1).indices
    return (pick, cand_ids.reshape(n, k * k).gather(1, pick), child_scores.gather(1, pick),
            child_alive.gather(1, pick))


def _records_to_host(records: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]
                     ) -> list[tuple[list[int], list, list, list]]:
    """Each draft depth's (requests, children's ids [n, k, k], log-probs [n, k, k], picks
    [n, k]) as lists, in one copy (float64: exact for the ids, picks and float32
    log-probs)."""
    if not records:
        return []
    parts = [t.reshape(-1).to(torch.float64) for _, ids, lps, pick in records
             for t in (ids, lps, pick)]
    flat = torch.cat(parts).cpu()
    out, at = [], 0
    for step, ids, lps, pick in records:
        got = []
        for t in (ids, lps, pick):
            got.append(flat[at:at + t.numel()].view(t.shape).tolist())
            at += t.numel()
        got[0] = [[[int(v) for v in beam] for beam in row] for row in got[0]]
        got[2] = [[int(v) for v in row] for row in got[2]]
        out.append((step, *got))
    return out


def _candidates_to_host(ids: torch.Tensor, logprobs: torch.Tensor
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """The head's top-k ids [R, k] and log-probs [R, k] as lists: off the CPU in one copy
    (both as float64, exact for the ids and the float32 log-probs), not one each."""
    if ids.device.type == "cpu":
        return ids.tolist(), logprobs.tolist()
    width = ids.shape[-1]
    both = torch.cat([ids.to(torch.float64), logprobs.to(torch.float64)], dim=-1).cpu().tolist()
    return [[int(t) for t in row[:width]] for row in both], [row[width:] for row in both]
