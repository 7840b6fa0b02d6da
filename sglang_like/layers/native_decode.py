"""The native decode path: each decoder layer as a few native CPU kernel calls, or one call a step.

It reads each layer as `DecoderLayerParts` (layers/decoder.py): a declared description and the
modules, never a model family's internals; `supports` says which descriptions the C kernels
implement.

A decode batch (every request one new token, no tree) of up to `MAX_ROWS` requests runs
RMSNorm fused with the residual add before it, the qkv matmul, (q/k norm +) RoPE + KV store +
attention in one call, o_proj, (output norm +) residual add + RMSNorm, gate_up, act*mul, down.
What a layer's description adds to Llama's (norm layouts, q/k norms, RoPE table or none,
sliding window, soft-cap, GeGLU, residual scale) is computed inside those same calls. The
per-layer arguments are gathered once into plain tuples (`NativeDecodePlan`), so a step pays
no nn.Module attribute lookups or module calls (a large part of a batch-1 step).

A batch under per-request masks (a speculative verify: trees, beside plain decode rows) of up
to `MAX_MASKED_ROWS` token rows runs the same calls: the attention kernel reads, for each
query row, one row of a key table, so `masked_rows` builds a table with one row per query
(the request's prefix slots, then the slots of the tree nodes its mask lets it see) once per
forward, and every layer reads it.

Where every linear is x16-packed int4 (`Q4X16Method`, `auto`'s int4 kernel without AMX) or a
GGUF type on kquants.c (`GGUFNativeMethod`, `--quantization gguf`), the whole step is one
native call instead (`sglang_like_kernels.cpu.decode_step_x16`,
decode_step.c): the same phases in one OpenMP team, the same bits, without a step's hundreds of
Python-to-C crossings, which at one row cost about as much as the matmuls.
`SGLANG_LIKE_FUSED_DECODE=0` keeps the per-op
calls (the tests compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_like.layers.decoder import DecoderLayerDescription, DecoderLayerParts
from sglang_like.layers.lora import LoraBatch, apply_lora
from sglang_like.layers.quantization.gguf_native import GGUFNativeMethod
from sglang_like.layers.quantization.q4_native import Q4X16Method
from sglang_like_kernels.cpu import KQ_KINDS, amx, isa, ops

if TYPE_CHECKING:
    from sglang_like.forward_batch import ForwardBatch
    from sglang_like.layers.norm import RMSNorm
    from sglang_like.mem_pool import KVPool

# Query rows up to which a decode batch runs natively; larger ones, and plain extends (prefill
# chunks without masks), keep the torch path. 256 since the native attention reads a shared
# prefix once too (its cascade): before, 64, where the torch path's cascade then won;
# docs/cpu-kernels.md has the measurements.
MAX_ROWS = 256
# A masked batch (a speculative verify) runs natively up to this many rows, so that its rows
# keep the float sums of the plain decode of the same requests (on the torch path, greedy
# speculation and plain decode can part at a near-tie). 256: where the int4 linears keep one
# kernel (quantization/int4.py).
MAX_MASKED_ROWS = 256

# The KV pool dtypes the native kernels read and write: float32, bfloat16, and the quantized
# pools (int8 / fp8 codes with their scales, sglang_like_kernels.kv_quant).
POOL_DTYPES = frozenset(ops.POOL_KINDS)

Linear = Callable[[torch.Tensor], torch.Tensor]
FUSED_ENV = "SGLANG_LIKE_FUSED_DECODE"


def supports(description: DecoderLayerDescription) -> bool:
    """Whether the native kernels compute a layer so described: RMS norms in any layout
    ("pre", "sandwich", "post"), a SiLU- or GeLU(tanh)-gated MLP, q/k norms per head or over
    the whole projection (the latter needs one rank: native runs only without tensor
    parallelism), the global, local or no RoPE table, any sliding window, soft-cap and
    residual scale; a dense MLP, or a mixture of experts (its SparseMoE called whole on the
    per-op path, moe.c's phases in the one-call step). Biases are added after the linears
    (the one-call step takes q/k/v's and o's; it refuses an MLP bias itself)."""
    d = description
    return (d.norm == "rms" and d.mlp in ("dense", "moe")
            and d.norm_layout in ("pre", "sandwich", "post")
            and d.activation in ops.ACTIVATIONS and d.qk_norm in ops.QK_NORMS
            and d.rope in ops.ROPES
            and (d.sliding_window is None or d.sliding_window >= 1)
            and (d.attn_logit_softcap is None or d.attn_logit_softcap > 0))


# A decode batch's requests whose rows begin with at least this many equal slots (a cached
# prefix they share) read those keys once together (attention.c's cascade); below it the
# rows alone cost about as much.
SHARED_PREFIX_MIN = 64


class AttnRows(NamedTuple):
    """Which keys each query row attends to: the first seq_lens[t] slots of table[rows[t]];
    rows sharing at least `shared_min` leading slots read them together (0: never)."""

    table: torch.Tensor  # int32 [*, width], contiguous
    rows: torch.Tensor  # int64 [T]
    seq_lens: torch.Tensor  # int64 [T]
    shared_min: int = 0


def decode_rows(fb: ForwardBatch, shared: bool = False) -> AttnRows:
    """A decode batch reads its requests' own rows of the slot table; `shared`: requests on
    one cached prefix read it together, which makes a row's float sums depend on the batch
    (so not in deterministic mode)."""
    return AttnRows(fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                    SHARED_PREFIX_MIN if shared else 0)


def extend_rows(fb: ForwardBatch, shared: bool = False) -> AttnRows:
    """A causal extend whose new tokens' slots are already in the table (a decode is an
    extend of one): new token i of request b reads the first prefix_len + i + 1 slots of its
    request's row. `shared`: as decode_rows'."""
    lens = fb.extend_lens
    rows = fb.req_pool_indices.repeat_interleave(lens)
    starts = (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)
    within = torch.arange(fb.num_tokens) - starts
    return AttnRows(fb.req_to_token, rows, fb.prefix_lens.repeat_interleave(lens) + within + 1,
                    SHARED_PREFIX_MIN if shared else 0)


def extend_runs_natively(fb: ForwardBatch, windowed: bool = False) -> bool:
    """Whether an extend batch (prefill chunks, with or without decode rows) runs the native
    step. On the AVX-512 build every one does: requests on a cached prefix (a shared system
    prompt, a conversation's next turn, a long prompt's later chunks) read it once for all
    their rows (the cascade), and a prompt's own causal run reads the keys before each block
    of 64 of its rows together (attention.c, split_causal), so a cold prompt's rows no longer
    read their whole prefix one at a time. On the 2-core AMX Xeon (`python -m
    benchmarks.bench_prefill_paths`) the torch path takes 1.30x the native step's time on a
    cold ~800-token prompt, 1.28x on 2,000 tokens, 1.41x on 32 cold prompts of ~30 tokens and
    2.29x on 32 new prompts on a cached ~800-token one (with AMX off, on AVX-512 VNNI: 1.29x /
    1.10x / 1.61x on the cold ones). Prompts whose tokens are scored (input logprobs) too: cold
    or on a cached prefix, their keys come from the same path, so a score does not depend on
    what the cache held (between the two paths, under int4, a token's logprob moves by up to
    0.26 nats).

    The AVX2 build keeps the rule from before the blocks: only requests continuing a cached
    prefix of at least SHARED_PREFIX_MIN tokens (and at least as long as what they add), with
    logits at their last rows only, so that a scored prompt runs the torch path cold or
    cached. Off AVX-512 the torch path multiplies prefill chunks by a dense GEMM, and no AVX2
    machine has timed the two on a cold prompt (forced on this Xeon, the AVX2 build read
    0.71-0.80x of a torch path whose GEMMs still ran AVX-512). So does a model with
    sliding-window layers (`windowed`): under a window there is no cascade, and each row
    reads its keys alone."""
    if not windowed and isa() == "avx512_vnni":
        return True
    prefix = fb.prefix_lens
    if not bool(((prefix >= SHARED_PREFIX_MIN) & (prefix >= fb.extend_lens)).all()):
        return False
    last_rows = torch.cumsum(fb.extend_lens, 0) - 1
    return bool(torch.isin(fb.logits_indices, last_rows).all())


def lora_columns(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B [N, R] -> (B.T [R, N] contiguous, int64 [R, 2]: each rank's nonzero columns [c0,
    c1), [0, 0) for none). A fused q/k/v or gate/up adapter's B is block diagonal: the
    decode step skips the zeros outside each rank's range, which add nothing."""
    bt = b.t().contiguous().to(torch.float32)
    nz = bt != 0
    any_nz = nz.any(dim=1)
    n = bt.shape[1]
    first = torch.where(any_nz, nz.to(torch.int8).argmax(dim=1), 0)
    last = torch.where(any_nz, n - nz.flip(1).to(torch.int8).argmax(dim=1), 0)
    return bt, torch.stack([first, last], dim=1).to(torch.int64).contiguous()


def masked_rows(fb: ForwardBatch) -> AttnRows:
    """A batch under `fb.custom_masks` as one key row per query.

    Request b's query i sees its prefix_len cached keys and the new key j iff mask[i, j]:

        table row of query i:  | req_to_token[r, :prefix_len] | slots of its visible new keys |
                               |<-------- prefix_len -------->|<----- mask[i].sum() ------->|

    The new keys are taken in order (j ascending), so a chain's rows read exactly what a
    plain decode at that position reads, in the same order. Where every request has one row
    that sees all its new keys, already in its row of the slot table, that row is read as it
    is (no table is built)."""
    r2t, masks = fb.req_to_token, fb.custom_masks
    assert masks is not None
    if all(m.shape[0] == 1 and bool(m.all()) for m in masks):
        # one row a request that sees every new key (an EAGLE chain's draft step, whose nodes
        # are in the request's row): those rows of the slot table as they are, no copy
        widths = torch.tensor([m.shape[1] for m in masks], dtype=torch.long)
        return AttnRows(r2t, fb.req_pool_indices, fb.prefix_lens + widths)
    prefixes = fb.prefix_lens.tolist()
    width = max(p + m.shape[1] for p, m in zip(prefixes, masks, strict=True))
    table = torch.empty(fb.num_tokens, max(width, 1), dtype=torch.int32)
    seq_lens = torch.empty(fb.num_tokens, dtype=torch.long)
    start = 0
    for r, p, mask in zip(fb.req_pool_indices.tolist(), prefixes, masks, strict=True):
        n, m = mask.shape
        if n == 0:
            continue
        keys = r2t[r, : p + m]
        seg = table[start : start + n]
        seg[:, :p] = keys[:p]
        if n == 1 and bool(mask.all()):
            seg[:, p : p + m] = keys[p:]  # a decode row (or one-row extend) beside the trees
            seq_lens[start] = p + m
        else:
            mask = mask.to(torch.bool)
            # each row's visible columns first, ascending; the rest (sentinel m) after them
            cols = torch.where(mask, torch.arange(m), m).sort(dim=1).values.clamp_(max=m - 1)
            seg[:, p : p + m] = keys[p:][cols]
            seq_lens[start : start + n] = mask.sum(dim=1) + p
        start += n
    return AttnRows(table, torch.arange(fb.num_tokens), seq_lens)


class _Norm(NamedTuple):
    weight: torch.Tensor
    eps: float
    out_dtype: torch.dtype


class _In(NamedTuple):
    """A sub-layer's input from the residual stream: rmsnorm(x) * weight in out_dtype, or
    x itself in out_dtype where weight is None (a "post" layer)."""

    weight: torch.Tensor | None
    eps: float
    out_dtype: torch.dtype


class _Out(NamedTuple):
    """A sub-layer's output into the residual stream: x += scale * (rmsnorm(out) * weight, or
    out where weight is None)."""

    weight: torch.Tensor | None
    eps: float
    scale: float


class _Layer(NamedTuple):
    attn_in: _In
    qkv: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_id: int
    sm_scale: float
    cos: torch.Tensor | None  # this layer's RoPE table pair; None: no rotation
    sin: torch.Tensor | None
    attn_kw: dict  # window, soft-cap and q/k norm keywords of ops.decode_attention_rope
    o_in_dtype: torch.dtype
    o_proj: Linear
    attn_out: _Out
    mlp_in: _In
    gate_up: Linear | None
    activation: str
    down_in_dtype: torch.dtype | None
    down: Linear | None
    mlp_out: _Out
    moe: Linear | None  # a sparse layer's whole MLP (gate_up and down None)


def _input(norm: RMSNorm | None, linear: torch.nn.Module, eps: float) -> _In:
    if norm is None:
        return _In(None, eps, linear.method.input_dtype)
    return _In(norm.weight, norm.eps, norm.out_dtype)


def _output(norm: RMSNorm | None, eps: float, scale: float) -> _Out:
    return _Out(None if norm is None else norm.weight, eps if norm is None else norm.eps,
                scale)


def _linear(layer: torch.nn.Module) -> Linear:
    return layer.method.decode_fn(layer)


RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _rope_tables(rope_tables: RopeTables | torch.Tensor,
                 sin_table: torch.Tensor | None) -> RopeTables:
    """{"global": (cos, sin), "local": ...} from the dict form or the older (cos, sin) one."""
    if isinstance(rope_tables, dict):
        if sin_table is not None or "global" not in rope_tables:
            raise ValueError("rope tables: a dict with a 'global' pair, and no separate sin")
        return dict(rope_tables)
    if sin_table is None:
        raise ValueError("rope tables: (cos, sin) or {'global': (cos, sin), ...}")
    return {"global": (rope_tables, sin_table)}


def _attn_keywords(p: DecoderLayerParts) -> dict:
    d = p.description
    kw: dict = {"window": d.sliding_window, "softcap": d.attn_logit_softcap}
    if d.qk_norm is not None:
        if p.q_norm is None or p.k_norm is None or p.q_norm.eps != p.k_norm.eps:
            raise ValueError(f"layer {p.layer_id}: q/k norm {d.qk_norm!r} needs both norms, "
                             "of one eps")
        kw.update(qk_norm=d.qk_norm, q_norm=p.q_norm.weight.float().contiguous(),
                  k_norm=p.k_norm.weight.float().contiguous(), qk_eps=p.q_norm.eps)
    return kw


class NativeDecodePlan:
    """What every decode step of one model needs from its layers, gathered once.

    `rope_tables`: {"global": (cos, sin)} and, where layers rotate by Gemma 3's local table,
    "local": (cos, sin), each [P, D] float32 ([cos, cos] and [-sin, sin] rows); the older
    call `NativeDecodePlan(layers, cos, sin)` means the global pair alone."""

    def __init__(self, layers: list[DecoderLayerParts],
                 rope_tables: RopeTables | torch.Tensor,
                 sin_table: torch.Tensor | None = None) -> None:
        unsupported = [p.layer_id for p in layers if not supports(p.description)]
        if unsupported:
            raise ValueError(f"layers {unsupported[:4]} are not what the native step computes")
        # on AMX CPUs the AMX library lends the attention's cascade its tile kernel as it
        # loads; a model with no quantized layer has not loaded it yet
        amx.available()
        tables = _rope_tables(rope_tables, sin_table)
        missing = sorted({p.description.rope for p in layers} - set(tables) - {"none"})
        if missing:
            raise ValueError(f"the layers rotate by RoPE tables {missing} the plan was not given")
        self.tables = tables
        self.cos, self.sin = tables["global"]
        self.layers = []
        for p in layers:
            d = p.description
            cos, sin = tables[d.rope] if d.rope != "none" else (None, None)
            moe = p.moe
            # what the MLP's input feeds: its gate_up, or (sparse) the experts' first
            mlp_first = p.gate_up_proj if moe is None else moe.experts[0].gate_up_proj
            self.layers.append(_Layer(
                _input(p.input_norm, p.qkv_proj, d.norm_eps), _linear(p.qkv_proj), p.num_heads,
                p.num_kv_heads, p.head_dim, p.layer_id, p.sm_scale, cos, sin, _attn_keywords(p),
                p.o_proj.method.input_dtype, _linear(p.o_proj),
                _output(p.attn_out_norm, d.norm_eps, d.residual_scale),
                _input(p.mlp_norm, mlp_first, d.norm_eps),
                None if moe else _linear(p.gate_up_proj), d.activation,
                None if moe else p.down_proj.method.input_dtype,
                None if moe else _linear(p.down_proj),
                _output(p.mlp_out_norm, d.norm_eps, d.residual_scale), moe))
        # each layer's linears' keys in an adapter's weights (qkv, o, gate_up, down; "" for a
        # sparse layer's MLP, which adapters cannot target)
        self.lora_keys = [tuple("" if lin is None else lin.lora_key for lin in p.linears)
                          for p in layers]
        self.fused = _FusedX16.build(layers, tables)
        if self.fused is not None:
            self.fused.lora_keys = self.lora_keys

    def run(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool, attn: AttnRows,
            aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream after the last layer, EAGLE-3 features or None), as
        a model's `forward_layers`; x is the embedded batch, float32 [T, hidden], one
        row per query of `attn`."""
        if self.fused is not None and fb.on_layer is None:
            return self.fused.run(x, fb, pool, attn, aux_layers)
        attend, residual_norm, act_mul = ops.decode_attention_rope, ops.residual_norm, ops.act_mul
        positions, out_slots, on_layer = fb.positions, fb.out_slots, fb.on_layer
        lb: LoraBatch | None = fb.lora

        def lin(f: Linear, x: torch.Tensor, key: str) -> torch.Tensor:
            y = f(x)
            return y if lb is None else apply_lora(y, x, key, lb)

        table, rows, seq_lens = attn.table, attn.rows, attn.seq_lens
        k_buffers, v_buffers = pool.k_buffers, pool.v_buffers
        k_scales, v_scales = pool.k_scales, pool.v_scales  # None: a float pool
        layers = self.layers
        last = len(layers) - 1
        first = layers[0].attn_in
        h = ops.rmsnorm(x, *first) if first.weight is not None else x.to(first.out_dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, p in enumerate(layers):
            keys = self.lora_keys[i]
            if i in aux_layers:
                aux[i] = x  # never written in place: each step makes a new residual tensor
            a = attend(lin(p.qkv, h, keys[0]), p.num_heads, p.num_kv_heads, p.head_dim, p.cos,
                       p.sin, positions, k_buffers[p.layer_id], v_buffers[p.layer_id], out_slots,
                       table, rows, seq_lens, p.sm_scale, p.o_in_dtype, **p.attn_kw,
                       k_scale=None if k_scales is None else k_scales[p.layer_id],
                       v_scale=None if v_scales is None else v_scales[p.layer_id],
                       shared_min=attn.shared_min)
            x, h = residual_norm(x, lin(p.o_proj, a, keys[1]), *p.mlp_in, *p.attn_out)
            if p.moe is not None:
                down = p.moe(h)
            else:
                down = lin(p.down, act_mul(lin(p.gate_up, h, keys[2]), p.activation,
                                           p.down_in_dtype), keys[3])
            # the next layer's input (the last layer's add only: no norm, float32)
            nxt = layers[i + 1].attn_in if i < last else _In(None, 0.0, torch.float32)
            x, h = residual_norm(x, down, *nxt, *p.mlp_out)
            if on_layer is not None:
                on_layer(i)
        features = torch.cat([aux[i] for i in aux_layers], dim=-1) if aux_layers else None
        return x, features


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    """A norm's weight as the native kernels read it (float32, contiguous; None: no norm)."""
    return None if norm is None else norm.weight.float().contiguous()


def _bias(lin: torch.nn.Module) -> torch.Tensor | None:
    """A linear's bias as the fused step reads it (float32, contiguous), None without."""
    return None if lin.bias is None else lin.bias.detach().float().contiguous()


def fused_runs(lin: torch.nn.Module) -> list[tuple[int, torch.Tensor, int]] | None:
    """A linear as the fused step's runs (kquants.c kind or -1 for x16, packed weight, rows),
    or None where the step cannot run it."""
    if isinstance(lin.method, Q4X16Method):
        return [(-1, lin.x16, lin.x16_shape[0])]
    method = getattr(lin, "gguf_method", lin.method)
    if not isinstance(method, GGUFNativeMethod) or len(lin.kq_runs) > ops.DECODE_STEP_RUNS:
        return None
    return [(KQ_KINDS[kind], packed, rows) for kind, rows, packed in method.packed_runs(lin)]


class _FusedX16:
    """A whole decode step as one `decode_step_x16` call: the layers' addresses gathered once
    into an int64 table [L, 12] (qkv, o, gate_up, down weights; the norms before attention and
    the MLP; the layer's K and V pools, filled in for each pool it runs over; the norms on the
    sub-layers' outputs; the q/k norms: 0 where the layout has none), and each layer's
    settings (window, RoPE table, q/k norm, activation; scale, soft-cap, residual scale)."""

    _K, _V = 6, 7  # the pool columns of the table

    def __init__(self, layers: list[DecoderLayerParts], tables: RopeTables, eps: float) -> None:
        p0 = layers[0]
        self.cos, self.sin = tables["global"]
        self.local = tables.get("local")
        dense = [p for p in layers if p.moe is None]
        # the dense MLPs' width; a model without one passes its experts' (unused, valid)
        inter = dense[0].intermediate_size if dense else layers[0].moe.experts[0].intermediate_size
        self.shape = (len(layers), p0.num_heads, p0.num_kv_heads, p0.head_dim, inter)
        self.eps = eps
        self.sm_scale = p0.sm_scale
        self.layer_ids = [p.layer_id for p in layers]
        # a sparse layer's MLP linears have no runs here: its row of the moe table has them
        runs = [[fused_runs(lin) if lin is not None else [] for lin in p.linears]
                for p in layers]
        self.moe = None
        if len(dense) < len(layers):
            self.moe = torch.zeros(len(layers), ops.MOE_FIELDS, dtype=torch.int64)
            for i, p in enumerate(layers):
                if p.moe is not None:
                    self.moe[i] = p.moe.native_layer()
        # each layer's norm weights as the kernel reads them (float32, contiguous): before
        # attention, before the MLP, on their outputs, q, k (None where it has none)
        norms = [[_weight(n) for n in (p.input_norm, p.mlp_norm, p.attn_out_norm,
                                       p.mlp_out_norm)]
                 + ([_weight(p.q_norm), _weight(p.k_norm)] if p.description.qk_norm
                    else [None, None]) for p in layers]

        # qkv's and o's biases as the per-op path adds them (float32, after the matmul)
        biases = [[_bias(p.qkv_proj), _bias(p.o_proj)] for p in layers]

        def addr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        self.ptrs = torch.tensor([
            [r[0][1].data_ptr() if r else 0 for r in lr]
            + [addr(n[0]), addr(n[1]), 0, 0, *(addr(w) for w in n[2:]), *(addr(b) for b in bs)]
            for lr, n, bs in zip(runs, norms, biases, strict=True)], dtype=torch.int64)
        settings = [ops.layer_settings(
            p.description.sliding_window, p.description.rope, p.description.qk_norm,
            p.description.activation, p.sm_scale, p.description.attn_logit_softcap,
            p.description.residual_scale) for p in layers]
        self.cfg = torch.tensor([c for c, _ in settings], dtype=torch.int64)
        self.fcfg = torch.tensor([f for _, f in settings], dtype=torch.float32)
        # GGUF types (or x16 linears of more than one run): each linear's runs of rows
        self.runs = None
        if any(len(r) > 1 or r[0][0] >= 0 for lr in runs for r in lr if r):
            self.runs = torch.zeros(len(layers), 4, ops.DECODE_STEP_RUNS, 3, dtype=torch.int64)
            for i, lr in enumerate(runs):
                for j, r in enumerate(lr):
                    for k, (kind, buf, rows) in enumerate(r):
                        self.runs[i, j, k] = torch.tensor([kind, buf.data_ptr(), rows])
        # what the addresses point into, kept alive with them
        self._held = [t for lr, n, bs in zip(runs, norms, biases, strict=True)
                      for t in (*(buf for r in lr for _, buf, _ in r), *n, *bs) if t is not None]
        # a sparse layer's table row points into its SparseMoE's own cache (native_layer)
        self._held += [p.moe for p in layers if p.moe is not None]
        self._pool: KVPool | None = None
        self.kv_scales: torch.Tensor | None = None
        self._aux_slots: dict[tuple[int, ...], torch.Tensor] = {}
        self.lora_keys: list[tuple[str, ...]] = []
        # an adapter's [L, 4, 3] table of addresses, by id of its weights (held with it, so
        # the id stays its own while cached)
        self._lora_tabs: dict[int, tuple[dict, torch.Tensor, int, list]] = {}

    @classmethod
    def build(cls, layers: list[DecoderLayerParts], tables: RopeTables) -> _FusedX16 | None:
        """The fused step of these layers, or None where it does not apply: the env switch
        off, a linear not x16 or a GGUF kind (a sparse layer's experts included), an MLP
        linear with a bias, a shared expert moe.c cannot run, a norm not float32 (out) or of
        another eps than the others (the step takes one), layers that differ in shape, more
        window sizes than the step plans for."""
        if os.environ.get(FUSED_ENV, "1").strip() == "0" or not layers:
            return None
        first = layers[0]
        dense = [p for p in layers if p.moe is None]
        eps: float | None = None
        for p in layers:
            ins = [n for n in (p.input_norm, p.mlp_norm) if n is not None]
            outs = [n for n in (p.attn_out_norm, p.mlp_out_norm) if n is not None]
            qk = [n for n in (p.q_norm, p.k_norm) if n is not None and p.description.qk_norm]
            if eps is None:
                eps = (ins or outs or qk)[0].eps if (ins or outs or qk) else 1e-5
            mlp = ((p.gate_up_proj, p.down_proj) if p.moe is None
                   else (p.moe.experts[0].gate_up_proj,))
            if (any(fused_runs(lin) is None for lin in (p.qkv_proj, p.o_proj, *mlp))
                    or any(lin.bias is not None for lin in mlp)
                    # a sparse layer: its experts and any shared expert on moe.c
                    or (p.moe is not None and (p.moe.native_layer() is None or (
                        p.moe.shared_expert is not None
                        and not p.moe.native_shared(p.moe.native_layer()))))
                    or any(n.out_dtype != torch.float32 for n in ins)
                    or any(n.eps != eps or n.weight.dtype != torch.float32
                           for n in (*ins, *outs, *qk))
                    or (p.input_norm is None and p.qkv_proj.method.input_dtype != torch.float32)
                    or (p.mlp_norm is None and mlp[0].method.input_dtype != torch.float32)
                    or (p.num_heads, p.num_kv_heads, p.head_dim)
                    != (first.num_heads, first.num_kv_heads, first.head_dim)
                    or (p.moe is None and p.intermediate_size != dense[0].intermediate_size)):
                return None
        if len({p.description.sliding_window for p in layers}) > ops.DECODE_STEP_PLANS:
            return None
        tables = {k: (c.float().contiguous(), s.float().contiguous())
                  for k, (c, s) in tables.items()}
        return cls(layers, tables, eps)

    def _refresh_pool(self, pool: KVPool) -> None:
        """The pool's K/V buffer addresses into the table, once per pool (a pool makes its
        buffers when it is built and keeps them; holding it keeps them alive), and a
        quantized pool's scale addresses into `kv_scales` [L, 2]."""
        if pool is self._pool:
            return
        self.kv_scales = None
        if pool.k_scales is not None:
            self.kv_scales = torch.zeros(len(self.layer_ids), 2, dtype=torch.int64)
        for j, i in enumerate(self.layer_ids):
            for col, buf in ((self._K, pool.k_buffers[i]), (self._V, pool.v_buffers[i])):
                if not buf.is_contiguous():
                    raise ValueError("the fused decode step needs contiguous KV pool buffers")
                self.ptrs[j, col] = buf.data_ptr()
            if self.kv_scales is not None:
                self.kv_scales[j, 0] = pool.k_scales[i].data_ptr()
                self.kv_scales[j, 1] = pool.v_scales[i].data_ptr()
        self._pool = pool

    def _aux_slot(self, aux_layers: tuple[int, ...]) -> torch.Tensor:
        slots = self._aux_slots.get(aux_layers)
        if slots is None:
            slots = torch.full((len(self.layer_ids),), -1, dtype=torch.int64)
            for j, i in enumerate(aux_layers):
                slots[i] = j
            self._aux_slots[aux_layers] = slots
        return slots

    def _lora_tab(self, weights: dict) -> tuple[torch.Tensor, int]:
        """(an adapter's table [L, 4, 4] of (A, B.T, R, rank column ranges) per linear, its
        largest R); the B.T and range tensors live in the cache entry beside it."""
        hit = self._lora_tabs.get(id(weights))
        if hit is not None and hit[0] is weights:
            return hit[1], hit[2]
        tab = torch.zeros(len(self.lora_keys), 4, 4, dtype=torch.int64)
        rmax, held = 1, []
        for i, keys in enumerate(self.lora_keys):
            for j, key in enumerate(keys):
                w = weights.get(key)
                if w is not None:
                    bt, cols = lora_columns(w.b)
                    held += [bt, cols]
                    tab[i, j] = torch.tensor([w.a.data_ptr(), bt.data_ptr(), w.a.shape[0],
                                              cols.data_ptr()])
                    rmax = max(rmax, w.a.shape[0])
        if len(self._lora_tabs) >= 64:  # adapters come and go: keep the recent ones
            self._lora_tabs.pop(next(iter(self._lora_tabs)))
        self._lora_tabs[id(weights)] = (weights, tab, rmax, held)
        return tab, rmax

    def _lora_args(self, lb: LoraBatch, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        rows = torch.full((t,), -1, dtype=torch.int64)
        tabs, rmax = [], 1
        for s, (weights, sel) in enumerate(lb.groups):
            rows[sel] = s
            tab, r = self._lora_tab(weights)
            tabs.append(tab)
            rmax = max(rmax, r)
        return rows, torch.stack(tabs), rmax

    def run(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool, attn: AttnRows,
            aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._refresh_pool(pool)
        x = x.to(torch.float32, copy=True).contiguous()  # updated in place, layer by layer
        t, h = x.shape
        features = torch.empty(t, len(aux_layers) * h) if aux_layers else None
        num_layers, hq, hkv, d, inter = self.shape
        table, rows, seq_lens = attn.table, attn.rows, attn.seq_lens
        ops.decode_step_x16(num_layers, x, self.ptrs, self.eps, pool.k_buffers[0].dtype,
                            self.cos, self.sin, fb.positions, fb.out_slots, table, rows,
                            seq_lens, hq, hkv, d, inter, self.sm_scale,
                            self._aux_slot(aux_layers), features, runs=self.runs, cfg=self.cfg,
                            fcfg=self.fcfg, local_tables=self.local, kv_scales=self.kv_scales,
                            lora=None if fb.lora is None else self._lora_args(fb.lora, t),
                            moe=self.moe, shared_min=attn.shared_min)
        return x, features
