"""Torch references of the KV-pool kernels: the CPU path of the model and the test oracle.

Layout (per layer): ``k_pool``/``v_pool`` [num_slots, num_kv_heads, head_dim], slot 0 is a
padding slot; ``req_to_token`` [max_requests, max_context] int32 maps (request pool row,
position) -> slot id. All attention math is fp32; outputs are in q's dtype.

A quantized pool (``kv_quant``: int8 / fp8 codes) comes with ``k_scale``/``v_scale`` [num_slots,
num_kv_heads] float32; every path reads it through `_Dequantized`, which turns the rows it
gathers into float32, so the paths themselves are the same code for every pool.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from sglang_like_kernels import kv_quant

__all__ = [
    "fused_moe_ref",
    "lora_delta_",
    "apply_token_bitmask_",
    "check_window_softcap",
    "decode_attention",
    "extend_attention",
    "masked_attention",
    "store_kv",
    "tree_verify_attention",
]


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, Hkv, D] into pool rows slot_ids [T] (cast to the pool dtype; a quantized
    pool gets the rows' codes, and their scales go to k_scale / v_scale [num_slots, Hkv])."""
    slot_ids = slot_ids.to(device=k_pool.device, dtype=torch.long)
    if k_scale is None:
        k_pool.index_copy_(0, slot_ids, k.to(k_pool.dtype))
        v_pool.index_copy_(0, slot_ids, v.to(v_pool.dtype))
        return
    assert v_scale is not None
    for pool, scales, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        codes, scale = kv_quant.quantize(x, pool.dtype)
        kv_quant.as_bytes(pool).index_copy_(0, slot_ids, kv_quant.as_bytes(codes))
        scales.index_copy_(0, slot_ids, scale)


class _Dequantized:
    """A quantized pool as the attention paths read it: the rows a gather takes (index_select
    on dim 0, or indexing by a tensor of slots) come back float32 as stored, code * scale
    (rotated: the paths take a rotated query and rotate their output back, _over_rotated);
    shape and device are the codes'. Only the gathered rows are ever widened."""

    dtype = torch.float32

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.codes, self.scale = codes, scale
        self.shape, self.device = codes.shape, codes.device

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        return kv_quant.rotated_values(self.codes.index_select(0, index),
                                       self.scale.index_select(0, index))

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return kv_quant.rotated_values(self.codes[index], self.scale[index])


def _over_rotated(fn):
    """An attention path over a quantized pool, whose rows are stored rotated (kv_quant): its
    query rotated in, its output rotated back out; a float pool's call is fn itself."""
    @functools.wraps(fn)
    def run(q, k_pool, v_pool, *args, **kw):
        if not kv_quant.is_quantized(k_pool.dtype):
            return fn(q, k_pool, v_pool, *args, **kw)
        out = fn(kv_quant.query_for(q, k_pool.dtype), k_pool, v_pool, *args, **kw)
        return kv_quant.output_for(out, k_pool.dtype)
    return run


def _readable(pool: torch.Tensor, scale: torch.Tensor | None):
    """The pool as the paths gather from it (itself unless quantized)."""
    if scale is None:
        if kv_quant.is_quantized(pool.dtype):
            raise ValueError(f"a {pool.dtype} KV pool needs its scales (k_scale / v_scale)")
        return pool
    return _Dequantized(pool, scale)


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """A window holds at least the query's own key; a cap is a positive number."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one key, not {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft-cap must be positive, not {softcap}")


# Decode gathers are chunked so each buffer stays small: a single buffer of tens of MB is
# mmap-allocated and page-faulted afresh on every call, which costs more than the math.
_MAX_GATHER_ELEMENTS = 1 << 20


@_over_rotated
def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over its first seq_len cached tokens.

    q [B, Hq, D]; req_pool_indices, seq_lens [B]; returns [B, Hq, D] in q's dtype.
    Query head h reads kv head h // (Hq // Hkv). `window`: only the last `window` keys
    (positions max(0, n - window) .. n - 1); `softcap`: scores -> cap * tanh(scores / cap).
    """
    k_pool, v_pool = _readable(k_pool, k_scale), _readable(v_pool, v_scale)
    check_window_softcap(window, softcap)
    batch = q.shape[0]
    if batch == 0:
        return torch.empty_like(q)
    if window is not None or softcap is not None:
        return _decode_windowed(q, k_pool, v_pool, req_to_token, req_pool_indices, seq_lens,
                                sm_scale, window, softcap).to(q.dtype)
    plan = _decode_plan(req_to_token, req_pool_indices, seq_lens, k_pool.device)
    if not plan.groups:  # nothing shared: every request in one plain pass
        valid = None if plan.all_full else plan.valid
        return _decode_rows(q, k_pool, v_pool, plan.slots, valid, sm_scale).to(q.dtype)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for members, prefix_len in plan.groups:
        _cascade_decode(out, q, k_pool, v_pool, plan.slots, plan.lens, members, prefix_len,
                        sm_scale)
    rest = plan.rest
    if rest.numel():
        max_rest = int(plan.lens[rest].max())
        out[rest] = _decode_rows(q[rest], k_pool, v_pool, plan.slots[rest, :max_rest],
                                 plan.valid[rest, :max_rest], sm_scale)
    return out.to(q.dtype)


class _DecodePlan(NamedTuple):
    """What decode attention derives from the request table alone, the same for every layer."""

    slots: torch.Tensor  # [B, max_len] slot ids, 0 where past a request's length
    valid: torch.Tensor  # [B, max_len] bool
    lens: torch.Tensor  # [B]
    groups: list[tuple[torch.Tensor, int]]  # (members, shared prefix length) for the cascade
    rest: torch.Tensor  # requests outside every group
    all_full: bool  # every request has max_len keys (no padding to mask)


class _ForwardMemo:
    """The last plan built from a key of tensors, per thread: the model calls an attention
    once per layer with the very same tensors, so each plan is built once per forward. The
    memo holds the tensors (so their ids stay theirs) and their version counters (so an
    in-place write between calls rebuilds it); inference-mode tensors have no counters and
    are never memoized."""

    def __init__(self) -> None:
        self._local = threading.local()

    @staticmethod
    def _versions(key: tuple[torch.Tensor, ...]) -> tuple[int, ...] | None:
        try:
            return tuple(t._version for t in key)
        except RuntimeError:
            return None

    def get(self, key: tuple[torch.Tensor, ...]):
        entry = getattr(self._local, "entry", None)
        if entry is None or len(entry[0]) != len(key):
            return None
        versions = self._versions(key)
        if versions is None or entry[1] != versions or not all(
                a is b for a, b in zip(entry[0], key, strict=True)):
            return None
        return entry[2]

    def put(self, key: tuple[torch.Tensor, ...], plan):
        self._local.entry = (key, self._versions(key), plan)
        return plan


_plan_memo = _ForwardMemo()


def _decode_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    device: torch.device,
) -> _DecodePlan:
    """Built once per forward (see _ForwardMemo)."""
    key = (req_to_token, req_pool_indices, seq_lens)
    memo = _plan_memo.get(key)
    if memo is not None:
        return memo
    rows = req_pool_indices.to(device=device, dtype=torch.long)
    lens = seq_lens.to(device=device, dtype=torch.long)
    max_len = int(lens.max())
    slots = req_to_token[rows, :max_len].long()
    valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
    slots = torch.where(valid, slots, torch.zeros_like(slots))  # padding reads slot 0
    groups = _shared_prefix_groups(slots, lens)
    done = torch.zeros(rows.shape[0], dtype=torch.bool, device=device)
    for members, _ in groups:
        done[members] = True
    all_full = bool((lens == max_len).all())
    plan = _DecodePlan(slots, valid, lens, groups, (~done).nonzero().flatten(), all_full)
    return _plan_memo.put(key, plan)


def _decode_rows(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor | None,
    sm_scale: float,
) -> torch.Tensor:
    """Plain decode of requests that share nothing, chunked to bound the gather buffers."""
    row_elements = slots.shape[1] * k_pool.shape[1] * k_pool.shape[2]
    chunk = max(1, _MAX_GATHER_ELEMENTS // row_elements)
    if chunk >= q.shape[0]:
        return _decode_chunk(q, k_pool, v_pool, slots, valid, sm_scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[0], chunk):
        sl = slice(i, i + chunk)
        part = None if valid is None else valid[sl]
        out[sl] = _decode_chunk(q[sl], k_pool, v_pool, slots[sl], part, sm_scale)
    return out


# Cascade decode: requests whose rows begin with the same slot ids (a radix-cache hit makes
# them literally the same slots) attend to that shared prefix in one matmul over keys gathered
# once, then to their own suffixes; the two softmax partials merge by log-sum-exp. Below this
# many shared tokens the plain path is as fast.
_MIN_SHARED_PREFIX = 32


def _shared_prefix_groups(
    slots: torch.Tensor, lens: torch.Tensor
) -> list[tuple[torch.Tensor, int]]:
    """Groups of >= 2 requests with a common leading run of >= _MIN_SHARED_PREFIX slots."""
    if slots.shape[0] < 2 or slots.shape[1] <= _MIN_SHARED_PREFIX:
        return []
    first, inverse = torch.unique(slots[:, 0], return_inverse=True)
    groups = []
    for g in range(first.shape[0]):
        members = (inverse == g).nonzero().flatten()
        if members.numel() < 2:
            continue
        rows = slots[members]
        same = (rows == rows[:1]).all(dim=0).to(torch.int32)
        prefix_len = int(same.cumprod(0).sum())
        # the query's own token is never shared: keep at least one suffix key per request
        prefix_len = min(prefix_len, int(lens[members].min()) - 1)
        if prefix_len >= _MIN_SHARED_PREFIX:
            groups.append((members, prefix_len))
    return groups


def _softmax_partial(
    scores: torch.Tensor, values: torch.Tensor, equation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unnormalized output, row max, row sum) of softmax(scores) @ values."""
    m = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = torch.exp(scores - m)
    return torch.einsum(equation, e, values), m, e.sum(dim=-1, keepdim=True)


def _cascade_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    members: torch.Tensor,
    prefix_len: int,
    sm_scale: float,
) -> None:
    """Decode `members` (sharing slots[:, :prefix_len]) into out[members]."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    n = members.numel()
    qg = q[members].float().view(n, num_kv_heads, group, head_dim) * sm_scale
    # shared prefix: keys gathered once, every member's queries in one matmul per kv head
    prefix_slots = slots[members[0], :prefix_len]
    pk = k_pool.index_select(0, prefix_slots).float()  # [P, Hkv, D]
    pv = v_pool.index_select(0, prefix_slots).float()
    s1 = torch.einsum("nhgd,phd->nhgp", qg, pk)
    o1, m1, l1 = _softmax_partial(s1, pv, "nhgp,phd->nhgd")
    # each member's own suffix, padded to the longest
    suffix_lens = lens[members] - prefix_len
    max_suffix = int(suffix_lens.max())
    suffix_slots = slots[members, prefix_len : prefix_len + max_suffix]
    valid = torch.arange(max_suffix, device=slots.device)[None, :] < suffix_lens[:, None]
    suffix_slots = torch.where(valid, suffix_slots, torch.zeros_like(suffix_slots))
    sk = k_pool[suffix_slots].float()  # [n, S, Hkv, D]
    sv = v_pool[suffix_slots].float()
    s2 = torch.einsum("nhgd,nshd->nhgs", qg, sk)
    s2.masked_fill_(~valid[:, None, None, :], float("-inf"))
    o2, m2, l2 = _softmax_partial(s2, sv, "nhgs,nshd->nhgd")
    out[members] = _merge_partials(o1, m1, l1, o2, m2, l2).reshape(n, num_q_heads, head_dim)


def _merge_partials(
    o1: torch.Tensor, m1: torch.Tensor, l1: torch.Tensor,
    o2: torch.Tensor, m2: torch.Tensor, l2: torch.Tensor,
) -> torch.Tensor:
    """Combine two softmax partials over disjoint key sets into the normalized output."""
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)


def _decode_chunk(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor | None,
    sm_scale: float,
) -> torch.Tensor:
    """Decode for a few requests: q [b, Hq, D], slots/valid [b, L] (valid None: every slot is
    a key); returns fp32 [b, Hq, D].

    Keys are gathered in pool layout and viewed head-major (no copy) for SDPA; the math is
    fp32 (a half-precision pool's keys are upcast after the gather).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    length = slots.shape[1]
    flat = slots.reshape(-1)
    keys = k_pool.index_select(0, flat).view(batch, length, num_kv_heads, head_dim).float()
    values = v_pool.index_select(0, flat).view(batch, length, num_kv_heads, head_dim).float()
    mask = None if valid is None else valid[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().view(batch, num_q_heads, 1, head_dim), keys.transpose(1, 2),
        values.transpose(1, 2), attn_mask=mask, scale=sm_scale, enable_gqa=True,
    )
    return out.view(batch, num_q_heads, head_dim)


# Sliding windows and soft-capped scores (Mistral, Gemma 2/3) take plain exact paths of their
# own: SDPA has no soft-cap, and a window changes which keys a cascade group shares. The paths
# above are untouched for layers with neither.


def _memo_for(memos: dict[int | None, _ForwardMemo], window: int | None) -> _ForwardMemo:
    """One memo per window size: a model alternating sliding and full layers asks with the
    same tensors for both, and a single memo would rebuild at every layer."""
    memo = memos.get(window)
    if memo is None:
        memo = memos.setdefault(window, _ForwardMemo())
    return memo


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _attend_explicit(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    sm_scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [b, Hq, M, D], keys/values [b, Hkv, L, D] fp32, allowed bool broadcastable to
    [b, Hq, M, L] (None: every key). Scores are soft-capped before the mask; fp32 result."""
    b, num_q_heads, m, head_dim = q.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    rows = num_q_heads // num_kv_heads * m  # a kv head's query heads are consecutive
    scores = torch.matmul(q.reshape(b, num_kv_heads, rows, head_dim), keys.transpose(-1, -2))
    scores = _capped(scores * sm_scale, softcap).view(b, num_q_heads, m, length)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, num_kv_heads, rows, length)
    return torch.matmul(probs, values).view(b, num_q_heads, m, head_dim)


_window_decode_memos: dict[int | None, _ForwardMemo] = {}


def _window_decode_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, valid) [B, W]: each request's visible keys, the last `window` of its first
    seq_len (all of them for None), padding reading slot 0. Once per forward and window."""
    memo = _memo_for(_window_decode_memos, window)
    key = (req_to_token, req_pool_indices, seq_lens)
    plan = memo.get(key)
    if plan is not None:
        return plan
    rows = req_pool_indices.to(device=device, dtype=torch.long)
    lens = seq_lens.to(device=device, dtype=torch.long)
    lo = (lens - window).clamp_min(0) if window is not None else torch.zeros_like(lens)
    count = lens - lo
    within = torch.arange(int(count.max()), device=device)[None, :]
    valid = within < count[:, None]
    index = torch.where(valid, lo[:, None] + within, torch.zeros_like(within))
    slots = req_to_token[rows[:, None], index].long()
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    return memo.put(key, (slots, valid))


def _decode_windowed(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decode over each request's last `window` keys with capped scores; fp32 [B, Hq, D]."""
    slots, valid = _window_decode_plan(req_to_token, req_pool_indices, seq_lens, window,
                                       k_pool.device)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, length = k_pool.shape[1], slots.shape[1]
    chunk = max(1, _MAX_GATHER_ELEMENTS // (length * num_kv_heads * head_dim))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(0, batch, chunk):
        sl = slice(i, i + chunk)
        part = slots[sl]
        n = part.shape[0]
        flat = part.reshape(-1)
        keys = k_pool.index_select(0, flat).view(n, length, num_kv_heads, head_dim)
        values = v_pool.index_select(0, flat).view(n, length, num_kv_heads, head_dim)
        out[sl] = _attend_explicit(
            q[sl].float().view(n, num_q_heads, 1, head_dim), keys.float().transpose(1, 2),
            values.float().transpose(1, 2), valid[sl][:, None, None, :], sm_scale, softcap,
        ).view(n, num_q_heads, head_dim)
    return out


def _last_visible(allowed: torch.Tensor, window: int | None) -> torch.Tensor:
    """allowed [N, L] narrowed to each row's last `window` allowed keys (a query's visible
    keys in position order end at itself; None: unchanged)."""
    if window is None:
        return allowed
    at_or_after = allowed.flip(-1).cumsum(-1).flip(-1)
    return allowed & (at_or_after <= window)


def _attend_one(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor | None,
    sm_scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] over keys at slots [L] where allowed [N, L] (None: causal, N == L);
    returns fp32 [N, Hq, D].

    The operands are 4-D: given 3-D ones, torch's CPU SDPA takes its unfused math path,
    several times slower than the fused kernel (docs/cpu-kernels.md).
    """
    keys = k_pool.index_select(0, slots).float().transpose(0, 1)  # [Hkv, L, D]
    values = v_pool.index_select(0, slots).float().transpose(0, 1)
    if softcap is not None:
        if allowed is None:
            n = q.shape[0]
            allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out = _attend_explicit(q.float().transpose(0, 1)[None], keys[None], values[None],
                               allowed, sm_scale, softcap)
        return out[0].transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=allowed,
        is_causal=allowed is None,
        scale=sm_scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@_over_rotated
def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """New tokens attend to their request's cached prefix and causally to each other.

    q [T, Hq, D] packed by request in batch order (sum(extend_lens) == T); request b's new
    K/V sit at req_to_token[r, prefix_lens[b] : prefix_lens[b] + extend_lens[b]].
    `window`: the token at position p sees keys p - window < j <= p only; `softcap`: scores
    -> cap * tanh(scores / cap). `max_extend_len`: the Triton launcher's hint (unread here).
    Returns [T, Hq, D] in q's dtype.
    """
    k_pool, v_pool = _readable(k_pool, k_scale), _readable(v_pool, v_scale)
    check_window_softcap(window, softcap)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start, end, slots, allowed in _extend_plan(req_to_token, req_pool_indices, prefix_lens,
                                                   extend_lens, k_pool.device, window):
        out[start:end] = _attend_one(q[start:end], k_pool, v_pool, slots, allowed, sm_scale,
                                     softcap)
    return out.to(q.dtype)


_extend_memo = _ForwardMemo()
_masked_memo = _ForwardMemo()
_extend_window_memos: dict[int | None, _ForwardMemo] = {}
_masked_window_memos: dict[int | None, _ForwardMemo] = {}


def _extend_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    device: torch.device,
    window: int | None = None,
) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """(row start, row end, key slots, causal mask: None without a prefix) per request with
    new tokens, built once per forward and memoized like the decode plan (every layer asks
    with the same tensors). With a window the keys start at the first one any of the
    request's queries sees, and the mask is the band p - window < j <= p."""
    key = (req_to_token, req_pool_indices, prefix_lens, extend_lens)
    memo_store = _extend_memo if window is None else _memo_for(_extend_window_memos, window)
    memo = memo_store.get(key)
    if memo is not None:
        return memo
    plan = []
    start = 0
    for row, prefix_len, extend_len in zip(req_pool_indices.tolist(), prefix_lens.tolist(),
                                           extend_lens.tolist(), strict=True):
        if extend_len:
            total = prefix_len + extend_len
            query_pos = torch.arange(prefix_len, total, device=device)
            if window is None:
                slots = req_to_token[row, :total].to(device=device, dtype=torch.long)
                allowed = (torch.arange(total, device=device)[None, :] <= query_pos[:, None]
                           if prefix_len else None)
            else:
                lo = max(0, prefix_len + 1 - window)
                slots = req_to_token[row, lo:total].to(device=device, dtype=torch.long)
                key_pos = torch.arange(lo, total, device=device)[None, :]
                allowed = ((key_pos <= query_pos[:, None])
                           & (key_pos > query_pos[:, None] - window))
            plan.append((start, start + extend_len, slots, allowed))
        start += extend_len
    return memo_store.put(key, plan)


@_over_rotated
def tree_verify_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """N draft tokens per request attend to the prefix and to draft keys tree_mask allows.

    q [B*N, Hq, D]; draft K/V at positions prefix_len .. prefix_len+N-1 of the request's
    req_to_token row; tree_mask bool [B, N, N] (query i sees draft j iff tree_mask[b, i, j]).
    `window`: a query keeps the last `window` of its visible keys in position order (a
    node's visible keys are its path, so this is p - window < j <= p along it); `softcap`:
    scores -> cap * tanh(scores / cap). Returns [B*N, Hq, D] in q's dtype.
    """
    k_pool, v_pool = _readable(k_pool, k_scale), _readable(v_pool, v_scale)
    check_window_softcap(window, softcap)
    batch, num_draft, _ = tree_mask.shape
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    device = k_pool.device
    mask = tree_mask.to(device=device, dtype=torch.bool)
    rows = req_pool_indices.tolist()
    prefixes = prefix_lens.tolist()
    for b, (row, prefix_len) in enumerate(zip(rows, prefixes, strict=True)):
        slots = req_to_token[row, : prefix_len + num_draft].long()
        prefix_allowed = torch.ones(num_draft, prefix_len, dtype=torch.bool, device=device)
        allowed = _last_visible(torch.cat([prefix_allowed, mask[b]], dim=1), window)
        sl = slice(b * num_draft, (b + 1) * num_draft)
        out[sl] = _attend_one(q[sl], k_pool, v_pool, slots, allowed, sm_scale, softcap)
    return out.to(q.dtype)


@_over_rotated
def masked_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    masks: list[torch.Tensor],
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    positional: torch.Tensor | None = None,
    mask_meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries under a per-request mask over the keys after a fully visible prefix.

    Request b contributes masks[b].shape[0] query rows (packed in batch order) and reads keys
    req_to_token[r, : prefix_lens[b] + masks[b].shape[1]]; its queries see every one of the
    first prefix_lens[b] keys and key prefix_lens[b] + j iff masks[b][i, j]. A causal mask is
    an extend, a tree mask a speculative verify (or a draft step over the nodes so far).
    `window`: each query keeps the last `window` of its visible keys in order (as
    `tree_verify_attention`); `softcap`: scores -> cap * tanh(scores / cap). `mask_meta`:
    the Triton launcher's offsets of the masks (unused here: the masks are read).
    `positional[b]` (bool [B]): request b's mask is an extend's (row i at position prefix + i,
    column j at prefix + j) that may let a query see later keys (an image's rows both ways,
    Gemma 3); its window then keeps the keys less than `window` positions before the query,
    later ones included, as transformers' sliding layers do.
    Returns [sum of rows, Hq, D] in q's dtype.
    """
    k_pool, v_pool = _readable(k_pool, k_scale), _readable(v_pool, v_scale)
    check_window_softcap(window, softcap)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start, end, slots, allowed in _masked_plan(req_to_token, req_pool_indices, prefix_lens,
                                                   masks, k_pool.device, window, positional):
        out[start:end] = _attend_one(q[start:end], k_pool, v_pool, slots, allowed, sm_scale,
                                     softcap)
    return out.to(q.dtype)


def _masked_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    masks: list[torch.Tensor],
    device: torch.device,
    window: int | None = None,
    positional: torch.Tensor | None = None,
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(row start, row end, key slots, allowed keys) per request, once per forward."""
    key = (req_to_token, req_pool_indices, prefix_lens, *masks,
           *(() if positional is None else (positional,)))
    flags = [False] * len(masks) if positional is None else positional.tolist()
    memo_store = _masked_memo if window is None else _memo_for(_masked_window_memos, window)
    memo = memo_store.get(key)
    if memo is not None:
        return memo
    plan = []
    start = 0
    for row, prefix_len, mask, by_position in zip(req_pool_indices.tolist(),
                                                  prefix_lens.tolist(), masks, flags,
                                                  strict=True):
        rows, width = mask.shape
        if rows:
            slots = req_to_token[row, : prefix_len + width].to(device=device, dtype=torch.long)
            allowed = torch.cat([torch.ones(rows, prefix_len, dtype=torch.bool, device=device),
                                 mask.to(device=device, dtype=torch.bool)], dim=1)
            if by_position and window is not None:
                q_pos = torch.arange(prefix_len, prefix_len + rows, device=device)[:, None]
                k_pos = torch.arange(prefix_len + width, device=device)[None, :]
                allowed = allowed & (k_pos > q_pos - window)
            else:
                allowed = _last_visible(allowed, window)
            plan.append((start, start + rows, slots, allowed))
        start += rows
    return memo_store.put(key, plan)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] get -inf where bit (j % 32) of word bitmask[b, j // 32] is 0."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool().to(logits.device)
    logits.masked_fill_(~allowed, float("-inf"))


def lora_delta_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> None:
    """In place: y[t] += B[slots[t]] @ (A[slots[t]] @ x[t]) for every row t with a slot >= 0;
    a [S, R, K] and b [S, N, R] stacked adapters (zero-padded), float32 sums added in y's
    dtype (the oracle of triton_ops.lora_delta_)."""
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return
    s = slots[rows].long()
    u = torch.einsum("trk,tk->tr", a[s].float(), x[rows].float())
    delta = torch.einsum("tnr,tr->tn", b[s].float(), u)
    y[rows] = (y[rows].float() + delta).to(y.dtype)


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]), float32 [T, H] (the
    oracle of triton_ops.fused_moe, same shapes): one expert at a time over its rows in
    token order, each GEMM in the weights' dtype, act(gate) * up in that dtype, the scaled
    rows added in float32, as layers/moe.py's SparseMoE.experts_forward runs dense experts."""
    inter = w_down.shape[2]
    x = x.to(w_gate_up.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w_gate_up.shape[0]):
        tokens, k = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = torch.nn.functional.linear(x[tokens], w_gate_up[expert])
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if activation == "silu":
            act = torch.nn.functional.silu(gate) * up
        elif activation == "gelu_tanh":
            act = torch.nn.functional.gelu(gate, approximate="tanh") * up
        else:
            raise ValueError(f"unsupported activation {activation!r}")
        y = torch.nn.functional.linear(act, w_down[expert]).float()
        out.index_add_(0, tokens, y * topk_weights[tokens, k, None].float())
    return out
