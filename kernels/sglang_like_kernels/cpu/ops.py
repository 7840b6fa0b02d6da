"""torch-facing wrappers of the fused decode-step ops in ops.c (CPU tensors only).

Each takes and returns contiguous CPU tensors; activations are float32 or bfloat16 as the
caller's next matmul wants (`out_dtype`), the residual stream is float32, the KV pool float32,
bfloat16, or 8-bit codes (int8, fp8 e4m3 / e5m2) with float32 scales per slot and kv head
beside it (`sglang_like_kernels.kv_quant`). They are the model's decode path when
`sglang_like_kernels.cpu.available()`.
"""

from __future__ import annotations

import torch

from sglang_like_kernels.cpu import _lib

__all__ = ["POOL_KINDS", "act_mul", "add_rmsnorm", "argmax_rows", "decode_attention_rope",
           "decode_step_x16", "eagle_head_x16", "kv_quantize_rows", "moe_forward", "moe_layer",
           "pool_kind", "residual_norm", "rmsnorm", "silu_mul"]

_FLAGS = {torch.float32: 0, torch.bfloat16: 1}
# the C side's codes (ops.h, decode_step.c) of a layer description's values (layers/decoder.py)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
QK_NORMS = {None: 0, "head": 1, "full": 2}
ROPES = {"global": 0, "local": 1, "none": 2}


# attention.c's pool kinds (ops.h KV_*): float32 and bfloat16 keep the older flag's values
POOL_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3,
              torch.float8_e5m2: 4}


def pool_kind(dtype: torch.dtype) -> int:
    try:
        return POOL_KINDS[dtype]
    except KeyError:
        raise TypeError(f"the native KV pool is float32, bfloat16, int8 or fp8, not {dtype}"
                        ) from None


def _scales(pool: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[int | None, int | None]:
    """The scale addresses a pool of pool.dtype needs (None for a float pool), checked."""
    if pool_kind(pool.dtype) < 2:
        return None, None
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (t is None or t.dtype != torch.float32 or not t.is_contiguous()
                or tuple(t.shape) != tuple(pool.shape[:2])):
            raise TypeError(f"a {pool.dtype} pool needs {name}: contiguous float32 "
                            f"{tuple(pool.shape[:2])}")
    return k_scale.data_ptr(), v_scale.data_ptr()


def kv_quantize_rows(x: torch.Tensor, dtype: torch.dtype, *, rotated: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The native quantizer alone: x [..., D] float32 -> (codes, scales) as
    kv_quant.quantize (or kv_quant.quantize_rotated when `rotated`) makes them."""
    kind = pool_kind(dtype)
    if kind < 2:
        raise TypeError(f"{dtype} is not a quantized pool dtype")
    x = x.float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32)
    rc = _lib(None).kv_quantize_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], kind,
                                     int(rotated), codes.data_ptr(), scales.data_ptr())
    if rc != 0:
        raise MemoryError("kv_quantize_rows could not allocate its scratch memory")
    return codes.view(dtype), scales


def _flag(dtype: torch.dtype) -> int:
    try:
        return _FLAGS[dtype]
    except KeyError:
        raise TypeError(f"native CPU ops take float32 or bfloat16, not {dtype}") from None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype) -> torch.Tensor:
    """rmsnorm(x) * weight: x float32 [T, H] -> [T, H] in out_dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    _lib(None).add_rmsnorm(x.data_ptr(), None, 0, None, weight.data_ptr(), x.shape[0],
                           x.shape[1], eps, out.data_ptr(), _flag(out_dtype))
    return out


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta) * weight): the residual add and the next norm in one
    pass; x float32 [T, H], delta float32 or bfloat16 (a sub-layer's output as it comes)."""
    x, delta = x.contiguous(), delta.contiguous()
    x_out = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=out_dtype)
    _lib(None).add_rmsnorm(x.data_ptr(), delta.data_ptr(), _flag(delta.dtype), x_out.data_ptr(),
                           weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                           _flag(out_dtype))
    return x_out, out


def residual_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                  eps: float, out_dtype: torch.dtype, sub_weight: torch.Tensor | None = None,
                  sub_eps: float = 0.0, scale: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add after a sub-layer in any norm layout: (x', norm(x') in out_dtype) with
    x' = x + scale * sub, sub = rmsnorm(delta) * sub_weight (eps sub_eps) where `sub_weight`
    is given (the sub-layer's output norm), else delta; norm(x') = rmsnorm(x') * weight, or
    x' itself where `weight` is None (the next sub-layer reads the residual unnormed). At
    scale 1 without `sub_weight` it is `add_rmsnorm`, bit for bit."""
    x, delta = x.contiguous(), delta.contiguous()
    x_out = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=out_dtype)
    _lib(None).residual_norm(
        x.data_ptr(), delta.data_ptr(), _flag(delta.dtype),
        None if sub_weight is None else sub_weight.data_ptr(), sub_eps, scale, x_out.data_ptr(),
        None if weight is None else weight.data_ptr(), x.shape[0], x.shape[1], eps,
        out.data_ptr(), _flag(out_dtype))
    return x_out, out


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] projection -> [T, I]."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=out_dtype)
    _lib(None).silu_mul(gate_up.data_ptr(), _flag(gate_up.dtype), t, two_i // 2, out.data_ptr(),
                        _flag(out_dtype))
    return out


def act_mul(gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """act(gate) * up of a fused [T, 2I] projection -> [T, I]; `activation` "silu" or
    "gelu_tanh" (gelu's tanh form, as torch's gelu(approximate="tanh"))."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=out_dtype)
    _lib(None).act_mul(gate_up.data_ptr(), _flag(gate_up.dtype), t, two_i // 2,
                       ACTIVATIONS[activation], out.data_ptr(), _flag(out_dtype))
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() of a float32 [R, N] matrix whose rows are contiguous
    (any row stride): the first maximum of each row, a NaN counting as the maximum. torch's
    CPU argmax is slow on a batch's logits (docs/cpu-kernels.md); this reads from cache at
    SIMD width and splits rows over the team."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise TypeError("argmax_rows takes a float32 [R, N] matrix with contiguous rows")
    r, n = x.shape
    if n == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(r, dtype=torch.int64)
    if r:
        _lib(None).argmax_rows(x.data_ptr(), x.stride(0), r, n, out.data_ptr())
    return out.tolist()


def _window_softcap(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The C side's values: 0 for none."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one key, not {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft-cap must be positive, not {softcap}")
    return (window or 0), (softcap or 0.0)


def decode_attention_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                          cos_table: torch.Tensor | None, sin_table: torch.Tensor | None,
                          positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          out_slots: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          sm_scale: float, out_dtype: torch.dtype, *,
                          window: int | None = None, softcap: float | None = None,
                          qk_norm: str | None = None, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None,
                          qk_eps: float = 0.0, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          shared_min: int = 0, variant: str | None = None) -> torch.Tensor:
    """One decode step's attention from the fused qkv [B, (Hq + 2 Hkv) * D]: RoPE on q and k
    (tables [P, D]: [cos, cos] and [-sin, sin] rows; None: no rotation), k/v stored at
    `out_slots`, then each query over its request's first seq_len slots. Returns [B, Hq * D]
    in out_dtype. `window`: a query reads only the last `window` of its seq_len slots;
    `softcap`: scores -> cap * tanh(scores / cap); `qk_norm` "head" or "full" with float32
    weights q_norm / k_norm ([D], or [Hq D] / [Hkv D]) and eps `qk_eps`: q and k RMS-normed
    before RoPE (per head, or over all of a token's q / k rows). A quantized pool (int8 /
    fp8 codes) comes with its scales `k_scale` / `v_scale` [S, Hkv] float32: the new rows are
    quantized as kv_quant.quantize does, bit for bit, and every key read as code * scale.
    `shared_min` > 0 (no window): rows whose key rows begin with at least that many equal
    slots read those keys once for all of them (a cascade: a shared cached prefix costs one
    read, but a row's float sums then depend on which rows share it; 0: each row alone).
    `variant`: the build to run (default: this CPU's)."""
    qkv = qkv.contiguous()
    b = qkv.shape[0]
    out = torch.empty(b, num_heads * head_dim, dtype=out_dtype)
    if b == 0:
        return out
    if req_to_token.dtype != torch.int32 or not req_to_token.is_contiguous():
        raise TypeError("req_to_token must be a contiguous int32 table")
    window_value, softcap_value = _window_softcap(window, softcap)
    qk_code = QK_NORMS[qk_norm]
    if qk_code:
        size = head_dim if qk_norm == "head" else None
        for name, w, n in (("q_norm", q_norm, size or num_heads * head_dim),
                           ("k_norm", k_norm, size or num_kv_heads * head_dim)):
            if w is None or w.dtype != torch.float32 or w.numel() != n or not w.is_contiguous():
                raise TypeError(f"{name} must be a contiguous float32 weight of {n}")
    if (cos_table is None) != (sin_table is None):
        raise ValueError("RoPE takes both tables or neither")
    k_scale_ptr, v_scale_ptr = _scales(k_pool, k_scale, v_scale)
    rc = _lib(variant).decode_attention_rope(
        qkv.data_ptr(), _flag(qkv.dtype), b, num_heads, num_kv_heads, head_dim,
        None if cos_table is None else cos_table.data_ptr(),
        None if sin_table is None else sin_table.data_ptr(), positions.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), pool_kind(k_pool.dtype), out_slots.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
        seq_lens.data_ptr(), sm_scale, out.data_ptr(), _flag(out_dtype), window_value,
        softcap_value, qk_code, None if q_norm is None or not qk_code else q_norm.data_ptr(),
        None if k_norm is None or not qk_code else k_norm.data_ptr(), qk_eps, k_scale_ptr,
        v_scale_ptr, max(0, int(shared_min)))
    if rc != 0:
        raise MemoryError("decode_attention_rope could not allocate its scratch memory")
    return out


def shared_groups(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor, shared_min: int, variant: str | None = None
                  ) -> list[tuple[int, list[int]]]:
    """The cascade's groups `decode_attention_rope` forms for these query rows at
    `shared_min`: (keys the group reads together, its rows), rows in ascending order; a row
    in no group reads every key alone."""
    if req_to_token.dtype != torch.int32 or not req_to_token.is_contiguous():
        raise TypeError("req_to_token must be a contiguous int32 table")
    rows, lens = req_pool_indices.contiguous(), seq_lens.contiguous()
    b = rows.shape[0]
    group_of = torch.empty(b, dtype=torch.int64)
    len_of = torch.empty(max(b, 1), dtype=torch.int64)
    n = _lib(variant).attn_shared_groups(
        req_to_token.data_ptr(), req_to_token.stride(0), _int64("req_pool_indices", rows),
        _int64("seq_lens", lens), b, max(0, int(shared_min)), group_of.data_ptr(),
        len_of.data_ptr())
    if n < 0:
        raise MemoryError("attn_shared_groups could not allocate its scratch memory")
    members = group_of.tolist()
    return [(int(len_of[g]), [r for r in range(b) if members[r] == g]) for g in range(n)]


def _int64(name: str, t: torch.Tensor) -> int:
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous int64 tensor")
    return t.data_ptr()


DECODE_STEP_RUNS = 4  # decode_step.c's DS_RUNS
DECODE_STEP_PTRS = 14  # decode_step.c's DS_PTRS
DECODE_STEP_PLANS = 4  # DS_PLANS: distinct window sizes (None counting as one) a step takes
DECODE_STEP_CFG = 4  # DS_CFG: window, RoPE table, q/k norm, activation (ROPES, QK_NORMS, ...)
DECODE_STEP_FCFG = 3  # DS_FCFG: scale of the scores, soft-cap, residual scale


def layer_settings(window: int | None = None, rope: str = "global", qk_norm: str | None = None,
                   activation: str = "silu", sm_scale: float = 1.0, softcap: float | None = None,
                   residual_scale: float = 1.0) -> tuple[list[int], list[float]]:
    """One layer's rows of decode_step_x16's `cfg` and `fcfg`."""
    window_value, softcap_value = _window_softcap(window, softcap)
    return ([window_value, ROPES[rope], QK_NORMS[qk_norm], ACTIVATIONS[activation]],
            [sm_scale, softcap_value, residual_scale])


def decode_step_x16(num_layers: int, x: torch.Tensor, ptrs: torch.Tensor, eps: float,
                    pool_dtype: torch.dtype, cos_table: torch.Tensor, sin_table: torch.Tensor,
                    positions: torch.Tensor, out_slots: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, intermediate: int, sm_scale: float,
                    aux_slot: torch.Tensor, features: torch.Tensor | None,
                    variant: str | None = None, runs: torch.Tensor | None = None,
                    cfg: torch.Tensor | None = None, fcfg: torch.Tensor | None = None,
                    local_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                    kv_scales: torch.Tensor | None = None,
                    lora: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    moe: torch.Tensor | None = None, shared_min: int = 0) -> None:
    """Every layer of a decode or verify step (decode_step.c), x float32 [T, H] updated in
    place from the embedded rows to the residual stream after the last layer. `ptrs` int64
    [L, DECODE_STEP_PTRS]: addresses of each layer's x16 qkv, o, gate_up and down weights,
    its float32 norms before attention and before the MLP, its K and V pool buffers (of
    `pool_dtype`), its norms on attention's and the MLP's outputs, its q and k norms (0 where
    the layer has none), its float32 qkv and o biases (0 without). Query row t attends to
    the first seq_lens[t] slots of table[rows[t]] (int32 table) and stores its k/v at
    out_slots[t]. aux_slot int64 [L]: -1 or the column block of `features` [T, n * H] that
    receives the residual stream entering that layer.
    `variant`: the build to run (default: this CPU's). `runs` int64 [L, 4, DECODE_STEP_RUNS,
    3] (GGUF types): each linear as runs of output rows (kind of kquants.c or -1 for x16,
    weight address, rows; rows 0 ends a linear), in place of ptrs' weight addresses.
    `cfg` int64 [L, DECODE_STEP_CFG] and `fcfg` float32 [L, DECODE_STEP_FCFG]: each layer's
    settings (`layer_settings`; None: Llama's, scores scaled by sm_scale); `local_tables`:
    the cos/sin pair of the layers whose RoPE is "local". A quantized `pool_dtype` (int8,
    fp8) needs `kv_scales` int64 [L, 2]: each layer's K and V scale addresses ([S, Hkv]
    float32, as `decode_attention_rope`'s k_scale / v_scale). `lora`: (rows int64 [T], each
    row's adapter index or -1; tab int64 [S, L, 4, 4], adapter s's (A [R, K] address, B.T
    [R, N] address, R, address of int64 [R, 2] holding each rank's nonzero columns [c0, c1))
    for layer l's qkv, o, gate_up, down, A 0 where it has none; the largest R): each row
    adds its adapter's float32 B @ (A @ x) to those linears' outputs. `moe` int64
    [L, MOE_FIELDS] (None: every layer dense): a row with experts (`moe_layer`'s fields) makes
    that layer's MLP its mixture of experts. `shared_min`: `decode_attention_rope`'s, for
    every layer without a window."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise TypeError("x must be a contiguous float32 tensor")
    if table.dtype != torch.int32 or table.stride(-1) != 1:
        raise TypeError("the key table must be int32 with contiguous rows")
    if tuple(ptrs.shape) != (num_layers, DECODE_STEP_PTRS):
        raise ValueError(f"ptrs must be [{num_layers}, {DECODE_STEP_PTRS}]")
    if moe is not None and tuple(moe.shape) != (num_layers, MOE_FIELDS):
        raise ValueError(f"moe must be [{num_layers}, {MOE_FIELDS}]")
    if cfg is None:
        cfg = torch.zeros(num_layers, DECODE_STEP_CFG, dtype=torch.int64)
    if fcfg is None:
        fcfg = torch.tensor([[sm_scale, 0.0, 1.0]] * num_layers, dtype=torch.float32)
    if tuple(cfg.shape) != (num_layers, DECODE_STEP_CFG) or tuple(fcfg.shape) != (
            num_layers, DECODE_STEP_FCFG) or fcfg.dtype != torch.float32 or not (
            fcfg.is_contiguous()):
        raise ValueError("cfg / fcfg must be one row of settings per layer")
    t, h = x.shape
    if t == 0:
        return
    n_aux = 0 if features is None else features.shape[1] // h
    kind = pool_kind(pool_dtype)
    if kind >= 2 and (kv_scales is None or tuple(kv_scales.shape) != (num_layers, 2)):
        raise ValueError(f"a {pool_dtype} pool needs kv_scales [{num_layers}, 2]")
    cos_local, sin_local = local_tables if local_tables is not None else (None, None)
    lora_rows = lora_tab = None
    n_lora = rmax = 0
    if lora is not None:
        lora_rows, lora_tab, rmax = lora
        if tuple(lora_rows.shape) != (t,) or lora_tab.dim() != 4 or tuple(
                lora_tab.shape[1:]) != (num_layers, 4, 4):
            raise ValueError(f"lora: rows [{t}] and a table [S, {num_layers}, 4, 4]")
        n_lora = lora_tab.shape[0]
    rc = _lib(variant).decode_step_x16(
        num_layers, t, h, num_heads, num_kv_heads, head_dim, intermediate, x.data_ptr(),
        _int64("ptrs", ptrs), eps, kind, cos_table.data_ptr(),
        sin_table.data_ptr(), None if cos_local is None else cos_local.data_ptr(),
        None if sin_local is None else sin_local.data_ptr(), _int64("positions", positions),
        _int64("out_slots", out_slots), table.data_ptr(), table.stride(0),
        _int64("rows", rows), _int64("seq_lens", seq_lens), _int64("cfg", cfg),
        fcfg.data_ptr(), _int64("aux_slot", aux_slot), n_aux,
        None if features is None else features.data_ptr(),
        None if runs is None else _int64("runs", runs),
        None if kind < 2 else _int64("kv_scales", kv_scales),
        None if lora_rows is None else _int64("lora_rows", lora_rows),
        None if lora_tab is None else _int64("lora_tab", lora_tab), n_lora, rmax,
        None if moe is None else _int64("moe", moe), max(0, int(shared_min)))
    if rc == -2:
        raise ValueError(f"decode_step_x16 cannot take these shapes or settings (H={h}, heads "
                         f"{num_heads}/{num_kv_heads}x{head_dim}, intermediate {intermediate}; "
                         f"a local RoPE layer needs local_tables, at most 4 window sizes)")
    if rc != 0:
        raise MemoryError("decode_step_x16 could not allocate its scratch memory")


def eagle_head_x16(embeds: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   features: torch.Tensor, ptrs: torch.Tensor, eps: float,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                   out_slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                   vocab: int, sm_scale: float, logit_rows: torch.Tensor, d2t: torch.Tensor,
                   topk: int, variant: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's forward, its LM head and the top-k of its draft distribution in one
    call (eagle_head.c): (out float32 [T, H], the layer's output; target ids int64 [R, topk]
    and their log-probabilities float32 [R, topk], largest first, for rows `logit_rows` of
    out). `embeds`: the rows' embeddings float32 [T, H], or (codes, scale, ids int64 [T]) to
    embed them from the target's int8 rows: codes int8 [V, H] and scale float32 [V, H / 32],
    or the q8 x16 layout's (`q8_x16_pack`: 5-d codes). features float32
    [T, F]: the target's features when ptrs[0] (fc) is set, else the head's own outputs
    (F == H). ptrs int64 [10]: x16 fc, qkv, o, gate_up, down, lm_head weights, float32 norms
    of the embedding, the hidden input, post-attention and the output. d2t int64 [vocab]:
    draft id d is target id d + d2t[d]. Attention as `decode_step_x16`'s, over the head's
    one-layer pool."""
    if isinstance(embeds, tuple):
        codes, scale, ids = embeds
        if codes.dtype != torch.int8 or scale.dtype != torch.float32 or not (
                codes.is_contiguous() and scale.is_contiguous()):
            raise TypeError("the embedding must be contiguous int8 codes and float32 scales")
        x16 = codes.dim() == 5
        t, h = len(ids), (codes.shape[1] * 32 if x16 else codes.shape[1])
        if (scale.shape[-1] if not x16 else scale.shape[1]) * 32 != h:
            raise ValueError("the embedding's scales must be one per 32 columns")
        emb_args = (None, codes.data_ptr(), scale.data_ptr(), int(x16), _int64("ids", ids))
    else:
        if embeds.dtype != torch.float32 or not embeds.is_contiguous():
            raise TypeError("embeds must be a contiguous float32 tensor")
        t, h = embeds.shape
        emb_args = (embeds.data_ptr(), None, None, 0, None)
    if features.dtype != torch.float32 or not features.is_contiguous():
        raise TypeError("features must be a contiguous float32 tensor")
    if table.dtype != torch.int32 or table.stride(-1) != 1:
        raise TypeError("the key table must be int32 with contiguous rows")
    if tuple(ptrs.shape) != (10,) or tuple(d2t.shape) != (vocab,):
        raise ValueError(f"ptrs must be [10] and d2t [{vocab}]")
    out = torch.empty(t, h)
    top_ids = torch.empty(len(logit_rows), topk, dtype=torch.int64)
    top_lp = torch.empty(len(logit_rows), topk)
    if t == 0:
        return out, top_ids, top_lp
    rc = _lib(variant).eagle_head_x16(
        t, h, num_heads, num_kv_heads, head_dim, intermediate, vocab, features.shape[1],
        *emb_args, features.data_ptr(), _int64("ptrs", ptrs), eps, cos_table.data_ptr(),
        sin_table.data_ptr(), _int64("positions", positions), _int64("out_slots", out_slots),
        k_pool.data_ptr(), v_pool.data_ptr(), _flag(k_pool.dtype), table.data_ptr(),
        table.stride(0), _int64("rows", rows), _int64("seq_lens", seq_lens), sm_scale,
        out.data_ptr(), _int64("logit_rows", logit_rows), len(logit_rows), _int64("d2t", d2t),
        topk, top_ids.data_ptr(), top_lp.data_ptr())
    if rc == -2:
        raise ValueError(f"eagle_head_x16 cannot take these shapes (H={h}, features "
                         f"{features.shape[1]}, heads {num_heads}/{num_kv_heads}x{head_dim}, "
                         f"intermediate {intermediate}, vocab {vocab}, top-{topk})")
    if rc != 0:
        raise MemoryError("eagle_head_x16 could not allocate its scratch memory")
    return out, top_ids, top_lp


MOE_FIELDS = 12  # ops.h's MOE_*: E, top_k, I, renormalize, activation, router, gate_up, down,
# then the shared expert's width, gate, gate_up and down


def moe_layer(router: torch.Tensor, gate_up_runs: torch.Tensor, down_runs: torch.Tensor,
              top_k: int, intermediate_size: int, renormalize: bool, activation: str,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
              ) -> torch.Tensor:
    """A sparse layer as moe.c reads it: int64 [MOE_FIELDS] (the router float32 [E, H] and the
    experts' runs int64 [E, DECODE_STEP_RUNS, 3] by address: the caller keeps them alive).
    `shared`: a shared expert every token runs, (gate float32 [H], its gate_up and down runs
    int64 [DECODE_STEP_RUNS, 3], its width): its output, scaled by sigmoid(gate . x), is
    added after the routed experts' sum."""
    E = router.shape[0]
    tables = [("gate_up_runs", gate_up_runs, (E, DECODE_STEP_RUNS, 3)),
              ("down_runs", down_runs, (E, DECODE_STEP_RUNS, 3))]
    if shared is not None:
        tables += [("shared gate_up runs", shared[1], (DECODE_STEP_RUNS, 3)),
                   ("shared down runs", shared[2], (DECODE_STEP_RUNS, 3))]
        gate = shared[0]
        if gate.dtype != torch.float32 or not gate.is_contiguous() or gate.dim() != 1:
            raise TypeError("shared gate: contiguous float32 [H]")
    for name, runs, shape in tables:
        if runs.dtype != torch.int64 or not runs.is_contiguous() or tuple(runs.shape) != shape:
            raise TypeError(f"{name}: contiguous int64 {list(shape)}")
    if router.dtype != torch.float32 or not router.is_contiguous():
        raise TypeError("router: contiguous float32 [E, H]")
    sh = ([shared[3], shared[0].data_ptr(), shared[1].data_ptr(), shared[2].data_ptr()]
          if shared is not None else [0, 0, 0, 0])
    return torch.tensor([E, top_k, intermediate_size, int(renormalize), ACTIVATIONS[activation],
                         router.data_ptr(), gate_up_runs.data_ptr(), down_runs.data_ptr(), *sh],
                        dtype=torch.int64)


def moe_forward(x: torch.Tensor, layer: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor]
                | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, ids, weights) of a sparse layer (moe.c) for x float32 [T, H]: out float32 [T, H]
    the experts' sum (and the shared expert's, where the layer has one), ids int64 / weights
    float32 [T, top_k] the routing (each token's experts in ascending id). `routing` (ids,
    weights): use it instead of the router's."""
    x = x.float().contiguous()
    T, H = x.shape
    k = int(layer[1])
    if routing is None:
        ids = torch.empty(T, k, dtype=torch.int64)
        weights = torch.empty(T, k, dtype=torch.float32)
    else:
        ids = routing[0].to(torch.int64).contiguous().clone()
        weights = routing[1].float().contiguous().clone()
        if tuple(ids.shape) != (T, k) or ids.shape != weights.shape:
            raise TypeError(f"routing: ids and weights [{T}, {k}]")
    out = torch.empty_like(x)
    rc = _lib(None).moe_forward(T, H, x.data_ptr(), layer.data_ptr(), int(routing is None),
                                ids.data_ptr(), weights.data_ptr(), out.data_ptr())
    if rc == -1:
        raise MemoryError("moe_forward: scratch memory")
    if rc:
        raise ValueError(f"moe_forward: shapes, expert ids or runs it does not take (H={H}, "
                         f"layer={layer.tolist()[:5]})")
    return out, ids, weights
