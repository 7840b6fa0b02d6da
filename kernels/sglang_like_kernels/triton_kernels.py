"""The @triton.jit kernels over the KV pool; launchers with shapes live in triton_ops.

Every kernel loads its inputs in their stored dtype and converts to fp32 at once (the
interpreter has no bf16 arithmetic); ``DOT_DTYPE`` is the dtype fed to ``tl.dot``: fp32
(exact, ``ieee``) under the interpreter and for fp32 pools, the pool's 16-bit dtype on GPU.
Pool row offsets are computed in int64 so large pools cannot overflow.

A quantized pool (``KV_KIND`` 1 int8, 2 fp8 e4m3, 3 fp8 e5m2; 0 a float pool) holds 8-bit codes
and a float32 scale per (slot, kv head) in ``k_scale`` / ``v_scale``; `_load_kv_block` turns
codes into floats and multiplies by the row's scale. fp8 pools come as their bytes (uint8)
and are widened with integer ops (`_fp8_to_f32`), which the interpreter runs too (numpy has
no fp8) and every GPU has.

The attention kernels take a sliding ``window`` and a score ``softcap`` as runtime values,
switched on by the constexprs ``USE_WINDOW`` / ``USE_SOFTCAP``: with both off a kernel compiles
to what it was without them (Llama's layers pay nothing for Gemma's).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_pool, v_pool, slot_ids, k, v,
    stride_pool_s, stride_pool_h,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per token: pool[slot_ids[t]] = k[t], v[t] (same dtype as the pool)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ids + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    src_k = k + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    src_v = v + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    dst = slot * stride_pool_s + offs_h[:, None] * stride_pool_h + offs_d[None, :]
    tl.store(k_pool + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_pool + dst, tl.load(src_v, mask=mask), mask=mask)


@triton.jit
def _softcap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh as 1 - 2 / (e^2y + 1): saturates to +-1 without
    a NaN at any |y| (e^2y overflowing to inf gives 1), and needs only tl.exp, which the
    interpreter has too."""
    y = scores / softcap
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def _online_softmax_step(
    q, k, v, allowed, m_i, l_i, acc, sm_scale, softcap,
    DOT_DTYPE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Fold one key block into the running (max, sum, acc) of flash attention.

    q [M, D] and k, v [N, D] are DOT_DTYPE; allowed [M, N]. Rows with no allowed key so far
    keep m = -inf, l = 0, acc = 0 (no NaN: exponents are taken against a safe max of 0).
    Scores are soft-capped (USE_SOFTCAP) before the mask.
    """
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
    if USE_SOFTCAP:
        scores = _softcap(scores, softcap)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _fp8_to_f32(codes, KV_KIND: tl.constexpr):
    """fp8 bytes (e4m3 for KV_KIND 2, e5m2 for 3) -> float32, exact: the exponent and
    mantissa bits move into a float's place, then one multiply by 2^(127 - bias) rebiases
    (subnormal codes included)."""
    u = codes.to(tl.int32) & 0xFF
    sign = (u & 0x80) << 24
    if KV_KIND == 2:
        bits = sign | ((u & 0x7F) << 20)
        return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
    else:
        bits = sign | ((u & 0x7F) << 21)
        return bits.to(tl.float32, bitcast=True) * 5.192296858534828e33  # 2^112


@triton.jit
def _load_rows(pool, scale, offs, mask, slots, n_valid, kv_head, stride_scale_s,
               KV_KIND: tl.constexpr):  # fmt: skip
    """Rows [N, D] of one pool as float32: a float pool's values, or codes times scales."""
    if KV_KIND == 0:
        return tl.load(pool + offs, mask=mask, other=0.0).to(tl.float32)
    codes = tl.load(pool + offs, mask=mask, other=0)
    row_scale = tl.load(scale + slots * stride_scale_s + kv_head, mask=n_valid, other=0.0)
    if KV_KIND == 1:
        return codes.to(tl.float32) * row_scale[:, None]
    return _fp8_to_f32(codes, KV_KIND) * row_scale[:, None]


@triton.jit
def _load_kv_block(
    k_pool, v_pool, k_scale, v_scale, token_row, offs_n, n_valid, kv_head, offs_d, d_valid,
    stride_pool_s, stride_pool_h, stride_scale_s,
    DOT_DTYPE: tl.constexpr, KV_KIND: tl.constexpr,
):  # fmt: skip
    """K and V rows [N, D] for positions offs_n of one req_to_token row (invalid -> 0)."""
    slots = tl.load(token_row + offs_n, mask=n_valid, other=0).to(tl.int64)
    offs = slots[:, None] * stride_pool_s + kv_head * stride_pool_h + offs_d[None, :]
    mask = n_valid[:, None] & d_valid[None, :]
    k = _load_rows(k_pool, k_scale, offs, mask, slots, n_valid, kv_head, stride_scale_s,
                   KV_KIND).to(DOT_DTYPE)
    v = _load_rows(v_pool, v_scale, offs, mask, slots, n_valid, kv_head, stride_scale_s,
                   KV_KIND).to(DOT_DTYPE)
    return k, v


@triton.jit
def _query_rows(q, tokens, head, offs_d, m_valid, d_valid, stride_q_t, stride_q_h,
                DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Query rows `tokens` [M] of one head (or of `head` [M], a head per row) as a [M, D]
    block in DOT_DTYPE (invalid rows and columns 0), and the running (max, sum, acc) of
    flash attention before any key."""
    mask = m_valid[:, None] & d_valid[None, :]
    heads = tokens * 0 + head
    ptrs = q + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :]
    q_blk = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32).to(DOT_DTYPE)
    m_i = tl.full(tokens.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(tokens.shape, tl.float32)
    acc = tl.zeros([tokens.shape[0], offs_d.shape[0]], tl.float32)
    return q_blk, m_i, l_i, acc


@triton.jit
def _attend_prefix(
    q_blk, m_i, l_i, acc, m_valid, first_prefix, prefix_start, prefix_len,
    k_pool, v_pool, k_scale, v_scale, token_row, kv_head, offs_d, d_valid,
    stride_pool_s, stride_pool_h, stride_scale_s, sm_scale, softcap,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_KIND: tl.constexpr,
):  # fmt: skip
    """Fold keys [prefix_start, prefix_len) of one req_to_token row, each visible to every
    valid row (a verify's prefix, a decode split), into the running (max, sum, acc); with
    USE_WINDOW row i sees them from first_prefix[i] on."""
    for n0 in range(prefix_start, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < prefix_len
        k, v = _load_kv_block(
            k_pool, v_pool, k_scale, v_scale, token_row, offs_n, n_valid, kv_head, offs_d,
            d_valid, stride_pool_s, stride_pool_h, stride_scale_s, DOT_DTYPE, KV_KIND,
        )  # fmt: skip
        allowed = m_valid[:, None] & n_valid[None, :]
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] >= first_prefix[:, None])
        m_i, l_i, acc = _online_softmax_step(
            q_blk, k, v, allowed, m_i, l_i, acc, sm_scale, softcap, DOT_DTYPE, USE_SOFTCAP
        )
    return m_i, l_i, acc


@triton.jit
def _split_range(lo, hi, split, NUM_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """Keys [start, end) of split `split` of the keys [lo, hi), and whether it is the last
    split holding any (split 0 when the range is empty).

    A range is cut by its own length into pieces of at least SPLIT_MIN keys, whole tiles: a
    short one uses few of the NUM_SPLITS programs (the others find no keys and only write an
    empty partial), and with NUM_SPLITS 1 the one split is the whole range.
    """
    num_keys = tl.maximum(hi - lo, 0)
    split_len = tl.maximum(tl.cdiv(num_keys, NUM_SPLITS), SPLIT_MIN)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, hi)
    num_used = tl.maximum(tl.cdiv(num_keys, split_len), 1)
    return start, end, split == num_used - 1


@triton.jit
def _store_partial(mid_out, mid_lse, mid, m_i, l_i, acc, offs_d, row_valid, d_valid, head_dim):
    """One split's rows for split_reduce_kernel: acc normalised [M, D] to mid_out and the
    log-sum-exp to mid_lse at entries mid [M] (fp32, contiguous; lse -inf for a row the
    split saw no key of)."""
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))
    tl.store(mid_out + mid[:, None] * head_dim + offs_d[None, :], acc / l_safe[:, None],
             mask=row_valid[:, None] & d_valid[None, :])  # fmt: skip
    tl.store(mid_lse + mid, lse, mask=row_valid)


@triton.jit
def _write_rows(
    out, mid_out, mid_lse, tokens, head, split, m_i, l_i, acc, offs_d, m_valid, d_valid,
    stride_out_t, stride_out_h, num_q_heads, head_dim, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Query rows `tokens` of one head (or of `head` [M], a head per row): their output when
    one split saw all their keys, else this split's partial at mid entry (token, head, split)
    of [rows, Hq, NUM_SPLITS]."""
    heads = tokens * 0 + head
    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out + tokens[:, None] * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :]
        tl.store(dst, result.to(out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    else:
        mid = (tokens.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
        _store_partial(mid_out, mid_lse, mid, m_i, l_i, acc, offs_d, m_valid, d_valid, head_dim)


@triton.jit
def decode_split_kernel(
    q, k_pool, v_pool, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse,
    sm_scale, window, softcap,
    stride_q_b, stride_q_h, stride_pool_s, stride_pool_h, stride_scale_s, stride_table,
    num_q_heads, group, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_KIND: tl.constexpr, SPLIT_MIN: tl.constexpr,
):  # fmt: skip
    """Stage 1 of flash-decoding. Grid (B, Hkv, NUM_SPLITS).

    Each program scores the `group` query heads of one kv head over one contiguous split
    of the request's visible keys (its sequence; the last `window` of it with USE_WINDOW),
    split by the request's own length (_split_range: about min(NUM_SPLITS, its keys /
    SPLIT_MIN) splits) and writes the normalized partial output to mid_out
    [B, Hq, NUM_SPLITS, D] and its log-sum-exp to mid_lse [B, Hq, NUM_SPLITS] (both
    contiguous fp32; lse is -inf when the split is empty).
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    start, end, _ = _split_range(lo, seq_len, split, NUM_SPLITS, SPLIT_MIN, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < group
    d_valid = offs_d < head_dim
    heads = kv_head * group + offs_g
    # the block's rows are the group's query heads of request b
    q_blk, m_i, l_i, acc = _query_rows(q + b * stride_q_b, heads, 0, offs_d, g_valid, d_valid,
                                       stride_q_h, 0, DOT_DTYPE)
    token_row = req_to_token + row * stride_table
    # the window is in [start, end) already
    m_i, l_i, acc = _attend_prefix(
        q_blk, m_i, l_i, acc, g_valid, start, start, end,
        k_pool, v_pool, k_scale, v_scale, token_row, kv_head, offs_d, d_valid,
        stride_pool_s, stride_pool_h, stride_scale_s, sm_scale, softcap,
        BLOCK_N, DOT_DTYPE, False, USE_SOFTCAP, KV_KIND,
    )  # fmt: skip

    mid = (b * num_q_heads + heads) * NUM_SPLITS + split
    _store_partial(mid_out, mid_lse, mid, m_i, l_i, acc, offs_d, g_valid, d_valid, head_dim)


@triton.jit
def split_reduce_kernel(
    mid_out, mid_lse, out,
    stride_out_t, stride_out_h,
    num_q_heads, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Stage 2 of a split attention (decode, a verify's or a masked batch's prefix). Grid
    (rows, Hq): merge a query row's splits by their log-sum-exp (mid_out [rows, Hq,
    NUM_SPLITS, D], mid_lse [rows, Hq, NUM_SPLITS]). A row that no split saw a key of gets 0,
    as a one-split kernel writes it."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (t * num_q_heads + head) * NUM_SPLITS
    lse = tl.load(mid_lse + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    has_keys = lse > float("-inf")
    # the max is finite if any split has keys; where none has, every weight is 0 (not NaN)
    weights = tl.where(has_keys, tl.exp(lse - tl.max(lse, 0)), 0.0)
    parts_mask = has_keys[:, None] & (offs_d[None, :] < head_dim)
    parts = tl.load(mid_out + (base + offs_s)[:, None] * head_dim + offs_d[None, :],
                    mask=parts_mask, other=0.0)  # fmt: skip
    total = tl.sum(weights, 0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out + t * stride_out_t + head * stride_out_h + offs_d
    tl.store(dst, merged.to(out.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def extend_kernel(
    q, k_pool, v_pool, k_scale, v_scale, out, req_to_token, req_pool_indices, prefix_lens,
    extend_lens,
    extend_starts,
    sm_scale, window, softcap,
    stride_q_t, stride_q_h, stride_out_t, stride_out_h, stride_pool_s, stride_pool_h,
    stride_scale_s, stride_table,
    group, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    KV_KIND: tl.constexpr,
):  # fmt: skip
    """Grid (B, Hq, cdiv(max extend_len, BLOCK_M)): one block of new queries of one head.

    Query i of request b sits at position p = prefix_len + i and sees keys 0..p (with
    USE_WINDOW only p - window < j <= p).
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    row = tl.load(req_pool_indices + b).to(tl.int64)
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)
    extend_len = tl.load(extend_lens + b).to(tl.int32)
    q_start = tl.load(extend_starts + b).to(tl.int64)
    kv_head = head // group

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < extend_len
    d_valid = offs_d < head_dim
    q_mask = m_valid[:, None] & d_valid[None, :]
    tokens = q_start + offs_m
    q_blk, m_i, l_i, acc = _query_rows(q, tokens, head, offs_d, m_valid, d_valid, stride_q_t,
                                       stride_q_h, DOT_DTYPE)
    q_pos = prefix_len + offs_m
    token_row = req_to_token + row * stride_table
    # Keys beyond the block's last query are never visible; an empty block loops 0 times.
    key_end = prefix_len + tl.minimum(extend_len, m0 + BLOCK_M)
    key_end = tl.where(m0 < extend_len, key_end, 0)
    if USE_WINDOW:
        # nor keys before the block's first query's window
        key_start = tl.maximum(prefix_len + m0 + 1 - window, 0)
    else:
        key_start = 0
    for n0 in range(key_start, key_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < key_end
        k, v = _load_kv_block(
            k_pool, v_pool, k_scale, v_scale, token_row, offs_n, n_valid, kv_head, offs_d,
            d_valid, stride_pool_s, stride_pool_h, stride_scale_s, DOT_DTYPE, KV_KIND,
        )  # fmt: skip
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :] & m_valid[:, None]
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(
            q_blk, k, v, allowed, m_i, l_i, acc, sm_scale, softcap, DOT_DTYPE, USE_SOFTCAP
        )

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out + tokens[:, None] * stride_out_t + head * stride_out_h + offs_d[None, :]
    tl.store(dst, result.to(out.dtype.element_ty), mask=q_mask)


@triton.jit
def tree_verify_kernel(
    q, k_pool, v_pool, k_scale, v_scale, out, mid_out, mid_lse, req_to_token,
    req_pool_indices, prefix_lens, tree_mask,
    sm_scale, window, softcap,
    stride_q_t, stride_q_h, stride_out_t, stride_out_h, stride_pool_s, stride_pool_h,
    stride_scale_s, stride_table,
    num_draft, num_q_heads, group, head_dim,
    HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_KIND: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLIT_MIN: tl.constexpr,
):  # fmt: skip
    """Grid (B, Hq / HEADS, cdiv(num_draft * HEADS, BLOCK_R) * NUM_SPLITS): BLOCK_R of the
    num_draft x HEADS query rows of one request and set of HEADS query heads of one kv head
    (draft i of the set's head h at row i * HEADS + h) over one split of its prefix. With
    HEADS = group each key is read once per kv head and block, not once per query head (as
    decode_split_kernel groups its heads); HEADS 1 is a program per query head.

    Prefix keys 0..prefix_len-1 are all visible; draft key j (position prefix_len + j) is
    visible to draft query i iff tree_mask[b, i, j] (tree_mask: contiguous int8 [B, N, N]).
    With USE_WINDOW a query keeps only the last `window` of those in position order.
    BLOCK_M >= num_draft (the draft keys' block).

    The prefix keys the queries see are cut by the request's own length (_split_range, as
    decode's keys are), and the split that ends them also takes the draft keys. With
    NUM_SPLITS 1 the program writes `out`; else each writes its partial to mid_out
    [B*N, Hq, NUM_SPLITS, D] and mid_lse [B*N, Hq, NUM_SPLITS] (contiguous fp32) for
    split_reduce_kernel.
    """
    b = tl.program_id(0)
    first_head = tl.program_id(1) * HEADS
    kv_head = first_head // group
    r0 = (tl.program_id(2) // NUM_SPLITS) * BLOCK_R
    split = tl.program_id(2) % NUM_SPLITS
    row = tl.load(req_pool_indices + b).to(tl.int64)
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)

    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_r < num_draft * HEADS
    d_valid = offs_d < head_dim
    draft = offs_r // HEADS  # each row's draft query, and its query head
    heads = first_head + offs_r % HEADS
    tokens = b * num_draft + draft
    q_blk, m_i, l_i, acc = _query_rows(q, tokens, heads, offs_d, m_valid, d_valid, stride_q_t,
                                       stride_q_h, DOT_DTYPE)
    token_row = req_to_token + row * stride_table

    offs_j = tl.arange(0, BLOCK_M)
    j_valid = offs_j < num_draft
    pair_mask = m_valid[:, None] & j_valid[None, :]
    mask_row = tree_mask + b * num_draft * num_draft
    mask_ptrs = mask_row + draft[:, None] * num_draft + offs_j[None, :]
    draft_allowed = tl.load(mask_ptrs, mask=pair_mask, other=0) != 0
    if USE_WINDOW:
        # query i sees n_i = prefix_len + (its draft keys) keys and keeps the last `window`:
        # prefix keys from n_i - window on, and the draft keys with at most `window` visible
        # draft keys at or after them
        seen = draft_allowed.to(tl.int32)
        num_seen = tl.sum(seen, 1)
        first_prefix = prefix_len + num_seen - window
        at_or_after = num_seen[:, None] - tl.cumsum(seen, 1) + seen
        draft_allowed = draft_allowed & (at_or_after <= window)
        prefix_start = tl.maximum(tl.min(tl.where(m_valid, first_prefix, prefix_len), 0), 0)
    else:
        first_prefix = tl.zeros([BLOCK_R], tl.int32)  # unused without a window
        prefix_start = 0
    start, end, has_draft = _split_range(prefix_start, prefix_len, split, NUM_SPLITS,
                                         SPLIT_MIN, BLOCK_N)  # fmt: skip
    m_i, l_i, acc = _attend_prefix(
        q_blk, m_i, l_i, acc, m_valid, first_prefix, start, end,
        k_pool, v_pool, k_scale, v_scale, token_row, kv_head, offs_d, d_valid,
        stride_pool_s, stride_pool_h, stride_scale_s, sm_scale, softcap,
        BLOCK_N, DOT_DTYPE, USE_WINDOW, USE_SOFTCAP, KV_KIND,
    )  # fmt: skip

    if has_draft:
        k, v = _load_kv_block(
            k_pool, v_pool, k_scale, v_scale, token_row, prefix_len + offs_j, j_valid,
            kv_head, offs_d, d_valid, stride_pool_s, stride_pool_h, stride_scale_s, DOT_DTYPE,
            KV_KIND,
        )  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(
            q_blk, k, v, draft_allowed, m_i, l_i, acc, sm_scale, softcap, DOT_DTYPE,
            USE_SOFTCAP,
        )  # fmt: skip

    _write_rows(out, mid_out, mid_lse, tokens, heads, split, m_i, l_i, acc, offs_d, m_valid,
                d_valid, stride_out_t, stride_out_h, num_q_heads, head_dim, NUM_SPLITS)


@triton.jit
def masked_kernel(
    q, k_pool, v_pool, k_scale, v_scale, out, mid_out, mid_lse, req_to_token,
    req_pool_indices, prefix_lens, mask_meta, masks,
    sm_scale, window, softcap,
    stride_q_t, stride_q_h, stride_out_t, stride_out_h, stride_pool_s, stride_pool_h,
    stride_scale_s, stride_table, batch,
    num_q_heads, group, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    KV_KIND: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr,
):  # fmt: skip
    """Grid (B, Hq, cdiv(max rows, BLOCK_M) * NUM_SPLITS): one block of one request's
    queries under its own mask (ragged: every request its own rows and columns), over one
    split of its prefix.

    mask_meta int64 [5, B]: each request's first query row, its rows, the offset of its mask
    in `masks` (int8, row-major [rows, cols]), its cols, and 1 where the mask is an extend's
    windowed by position (`positional`). Request b's queries see its first prefix_len keys
    and key prefix_len + j iff its mask[i, j]. With USE_WINDOW a positional request's query
    i (at position prefix_len + i) keeps the keys less than `window` positions before it,
    later ones included; any other keeps the last `window` of its visible keys in position
    order, which needs each row's count of visible mask keys first (one pass over the mask
    before the keys are read).

    The block's prefix keys are split as tree_verify_kernel's (the split that ends them also
    takes the mask's keys); with NUM_SPLITS > 1 the partials go to mid_out [rows, Hq,
    NUM_SPLITS, D] and mid_lse [rows, Hq, NUM_SPLITS] for split_reduce_kernel.
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    m0 = (tl.program_id(2) // NUM_SPLITS) * BLOCK_M
    split = tl.program_id(2) % NUM_SPLITS
    num_rows = tl.load(mask_meta + batch + b).to(tl.int32)
    if m0 >= num_rows:
        return  # the grid is sized by the most rows: this request has none here
    q_start = tl.load(mask_meta + b)
    mask_start = tl.load(mask_meta + 2 * batch + b)
    num_cols = tl.load(mask_meta + 3 * batch + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)
    kv_head = head // group

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < num_rows
    d_valid = offs_d < head_dim
    tokens = q_start + offs_m
    q_blk, m_i, l_i, acc = _query_rows(q, tokens, head, offs_d, m_valid, d_valid, stride_q_t,
                                       stride_q_h, DOT_DTYPE)
    token_row = req_to_token + row * stride_table
    mask_rows = masks + mask_start + offs_m.to(tl.int64)[:, None] * num_cols
    q_pos = prefix_len + offs_m
    num_seen = tl.zeros([BLOCK_M], tl.int32)
    if USE_WINDOW:
        by_position = tl.load(mask_meta + 4 * batch + b) != 0
        if not by_position:
            for j0 in range(0, num_cols, BLOCK_N):
                offs_j = j0 + tl.arange(0, BLOCK_N)
                pair = m_valid[:, None] & (offs_j < num_cols)[None, :]
                seen = (tl.load(mask_rows + offs_j[None, :], mask=pair, other=0) != 0)
                num_seen += tl.sum(seen.to(tl.int32), 1)
        # the first visible prefix key of each row; the block starts at the least of them
        first_prefix = tl.where(by_position, q_pos - window + 1,
                                prefix_len + num_seen - window)
        prefix_start = tl.maximum(tl.min(tl.where(m_valid, first_prefix, prefix_len), 0), 0)
    else:
        by_position = False
        first_prefix = tl.zeros([BLOCK_M], tl.int32)
        prefix_start = 0
    start, end, has_mask_keys = _split_range(prefix_start, prefix_len, split, NUM_SPLITS,
                                             SPLIT_MIN, BLOCK_N)  # fmt: skip
    m_i, l_i, acc = _attend_prefix(
        q_blk, m_i, l_i, acc, m_valid, first_prefix, start, end,
        k_pool, v_pool, k_scale, v_scale, token_row, kv_head, offs_d, d_valid,
        stride_pool_s, stride_pool_h, stride_scale_s, sm_scale, softcap,
        BLOCK_N, DOT_DTYPE, USE_WINDOW, USE_SOFTCAP, KV_KIND,
    )  # fmt: skip

    # the other splits loop 0 times
    mask_end = tl.where(has_mask_keys, num_cols, 0)
    before = tl.zeros([BLOCK_M], tl.int32)  # visible mask keys in the blocks so far
    for j0 in range(0, mask_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_valid = offs_j < num_cols
        pair = m_valid[:, None] & j_valid[None, :]
        allowed = tl.load(mask_rows + offs_j[None, :], mask=pair, other=0) != 0
        if USE_WINDOW:
            if by_position:
                allowed = allowed & ((prefix_len + offs_j)[None, :] > q_pos[:, None] - window)
            else:
                seen = allowed.to(tl.int32)
                at_or_after = num_seen[:, None] - before[:, None] - tl.cumsum(seen, 1) + seen
                before += tl.sum(seen, 1)
                allowed = allowed & (at_or_after <= window)
        k, v = _load_kv_block(
            k_pool, v_pool, k_scale, v_scale, token_row, prefix_len + offs_j, j_valid, kv_head,
            offs_d, d_valid, stride_pool_s, stride_pool_h, stride_scale_s, DOT_DTYPE, KV_KIND,
        )  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(
            q_blk, k, v, allowed, m_i, l_i, acc, sm_scale, softcap, DOT_DTYPE, USE_SOFTCAP
        )

    _write_rows(out, mid_out, mid_lse, tokens, head, split, m_i, l_i, acc, offs_d, m_valid,
                d_valid, stride_out_t, stride_out_h, num_q_heads, head_dim, NUM_SPLITS)


@triton.jit
def token_bitmask_kernel(
    logits, bitmask, stride_logits, stride_bitmask, vocab_size,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (B, cdiv(V, BLOCK)): logits[b, j] = -inf where bit j % 32 of word j // 32 is 0."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    words = tl.load(bitmask + b * stride_bitmask + offs // 32, mask=valid, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = logits + b * stride_logits + offs
    # Only masked-out entries are written, so allowed logits keep their exact bits.
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32).to(logits.dtype.element_ty),
             mask=valid & ~allowed)  # fmt: skip


@triton.jit
def lora_shrink_kernel(
    x, a, slots, u, K, R, stride_x, stride_a_s, stride_a_r, stride_u,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(R, BLOCK_R)): u[t, r] = A[slots[t], r, :] . x[t, :] in float32 (rows
    with slot -1 are left alone). A is the batch's adapters stacked [S, R, K], zero-padded
    past each adapter's own rank (Punica's BGMV shrink: one gathered matrix-vector a row)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t)
    if slot < 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_valid = offs_r < R
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        xv = tl.load(x + t * stride_x + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        av = tl.load(a + slot * stride_a_s + offs_r[:, None] * stride_a_r + offs_k[None, :],
                     mask=r_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(u + t * stride_u + offs_r, acc, mask=r_valid)


@triton.jit
def lora_expand_kernel(
    u, b, slots, y, N, R, stride_u, stride_b_s, stride_b_n, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(N, BLOCK_N)): y[t, n] += B[slots[t], n, :] . u[t, :] (B stacked
    [S, N, R], zero-padded; the sum in float32, added in y's dtype); slot -1 rows untouched."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_valid = offs_r < R
        uv = tl.load(u + t * stride_u + offs_r, mask=r_valid, other=0.0)
        bv = tl.load(b + slot * stride_b_s + offs_n[:, None] * stride_b_n + offs_r[None, :],
                     mask=n_valid[:, None] & r_valid[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(bv * uv[None, :], axis=1)
    dst = y + t * stride_y + offs_n
    old = tl.load(dst, mask=n_valid, other=0.0).to(tl.float32)
    tl.store(dst, (old + acc).to(y.dtype.element_ty), mask=n_valid)


@triton.jit
def fused_moe_gemm_kernel(
    a, w, out, routing_weights, sorted_pair_ids, block_expert_ids, num_padded,
    N, K, num_pairs, pairs_per_row,
    stride_a, stride_w_e, stride_w_n, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
):  # fmt: skip
    """Grid (blocks of sorted_pair_ids, cdiv(N, BLOCK_N)): the grouped GEMM of fused MoE.

    Block i holds BLOCK_M (token, k) pair ids p = t * top_k + k, all routed to expert
    block_expert_ids[i] (triton_ops.moe_align; ids >= num_pairs are padding). For each real
    pair: out[p, n] = a[p // pairs_per_row, :] . w[e, n, :] (times routing_weights[p] with
    MUL_ROUTING_WEIGHT), summed in float32. w is [E, N, K] with unit stride in K; a row of a
    is a token (pairs_per_row = top_k) or a pair (1). Blocks at or past num_padded[0] (the
    launcher sizes the grid for the worst case, so the count never goes to the host) exit.
    """
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_expert_ids + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids + offs_m).to(tl.int64)
    m_valid = pairs < num_pairs
    rows = pairs // pairs_per_row
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    a_rows = a + rows[:, None] * stride_a
    w_cols = w + expert * stride_w_e + offs_n[None, :].to(tl.int64) * stride_w_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a_blk = tl.load(a_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :],
                        other=0.0).to(tl.float32).to(DOT_DTYPE)  # fmt: skip
        w_blk = tl.load(w_cols + offs_k[:, None], mask=k_valid[:, None] & n_valid[None, :],
                        other=0.0).to(tl.float32).to(DOT_DTYPE)  # fmt: skip
        acc += tl.dot(a_blk, w_blk, input_precision="ieee")
    if MUL_ROUTING_WEIGHT:
        scale = tl.load(routing_weights + pairs, mask=m_valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    dst = out + pairs[:, None] * stride_out + offs_n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
