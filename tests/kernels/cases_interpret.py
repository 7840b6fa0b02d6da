"""Triton kernels under TRITON_INTERPRET=1 vs the torch references, every element checked.

Not collected on its own: test_triton_kernels.py runs it in a subprocess with the
interpreter on, because the flag must be set before triton compiles the kernels.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before sglang_like_kernels.triton_ops imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_like_kernels import reference, triton_ops  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch):
    """Outputs and scratch start as NaN, so an element the kernel skips cannot pass."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_ops, "_empty", nan_empty)


def _check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not out.isnan().any(), "an output element was never written"
    tol = 1e-3 if dtype == F32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol * 1e-2)
    scale = want.float().abs().max()
    assert (out.float() - want.float()).abs().max() <= tol * scale


class _Pool:
    """Random pools and a req_to_token table whose rows hold distinct random slots."""

    def __init__(self, lens, num_kv_heads, head_dim, dtype, seed, max_context=320):
        self.gen = torch.Generator().manual_seed(seed)
        num_slots = sum(lens) + 50
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=self.gen).to(dtype)
        self.v = torch.randn(shape, generator=self.gen).to(dtype)
        # Unused table cells hold real slot ids, so reading past a length would show.
        self.table = torch.randint(1, num_slots, (len(lens) + 2, max_context), generator=self.gen)
        self.table = self.table.to(torch.int32)
        perm = torch.randperm(num_slots - 1, generator=self.gen) + 1
        self.rows = torch.randperm(len(lens) + 2, generator=self.gen)[: len(lens)]
        start = 0
        for row, n in zip(self.rows.tolist(), lens, strict=True):
            self.table[row, :n] = perm[start : start + n].int()
            start += n

    def randn(self, *shape, dtype):
        return torch.randn(shape, generator=self.gen).to(dtype)


DECODE_CASES = [
    # lens, Hq, Hkv, D, dtype, num_splits (None: launcher default)
    ([1, 37, 200], 2, 2, 64, F32, None),
    ([3, 129, 64], 9, 3, 80, F32, 4),
    ([250, 1, 17], 8, 2, 96, F16, 3),
    ([65, 300], 8, 1, 128, BF16, 8),
    ([7, 90], 4, 1, 80, F32, 16),
]


@pytest.mark.parametrize("lens,num_q_heads,num_kv_heads,head_dim,dtype,num_splits", DECODE_CASES)
def test_decode(lens, num_q_heads, num_kv_heads, head_dim, dtype, num_splits):
    pool = _Pool(lens, num_kv_heads, head_dim, dtype, seed=len(lens) * head_dim)
    q = pool.randn(len(lens), num_q_heads, head_dim, dtype=dtype)
    seq_lens = torch.tensor(lens)
    args = (q, pool.k, pool.v, pool.table, pool.rows, seq_lens, 1 / math.sqrt(head_dim))
    want = reference.decode_attention(*args)
    # every split in use (split_min 1), and the launcher's default minimum split
    _check(triton_ops.decode_attention(*args, num_splits=num_splits, split_min=1), want, dtype)
    _check(triton_ops.decode_attention(*args, num_splits=num_splits), want, dtype)


def test_decode_splits_follow_each_requests_length(monkeypatch):
    """Each request splits its own keys in pieces of at least split_min (whole tiles): a
    short one fills one of the NUM_SPLITS partials, a long one all of them; the rest stay
    empty (-inf log-sum-exp) and the merge still gives the reference."""
    lse = []

    def recording_empty(shape, dtype, device):
        t = torch.full(shape, float("nan"), dtype=dtype, device=device)
        if tuple(shape) == (4, 4, 8):  # mid_lse [B, Hq, NUM_SPLITS]
            lse.append(t)
        return t

    monkeypatch.setattr(triton_ops, "_empty", recording_empty)
    lens = [5, 40, 300, 1000]
    pool = _Pool(lens, 2, 64, F32, seed=4, max_context=1024)
    q = pool.randn(len(lens), 4, 64, dtype=F32)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(lens), 0.125)
    out = triton_ops.decode_attention(*args, num_splits=8, split_min=64)
    _check(out, reference.decode_attention(*args), F32)
    used = (lse[0] > float("-inf")).sum(-1)  # [B, Hq]
    tile = triton_ops.decode_meta(4, 2, 64, 1024, F32)["BLOCK_N"]
    assert tile == 64
    # 5, 40: one split; 300: pieces of 64 -> 5; 1000: pieces of 125 -> 128 -> 8
    assert used.tolist() == [[n] * 4 for n in (1, 1, 5, 8)]


EXTEND_CASES = [
    # prefix_lens, extend_lens, Hq, Hkv, D, dtype
    ([0, 5, 100], [1, 70, 20], 3, 1, 64, F32),
    ([0], [130], 4, 1, 80, BF16),
    ([40, 0, 7], [3, 9, 0], 4, 1, 96, F16),
    ([200, 2], [5, 1], 2, 2, 128, F32),
    ([16, 33], [20, 66], 8, 1, 64, F32),
]


EXTEND_ARGS = "prefix_lens,extend_lens,num_q_heads,num_kv_heads,head_dim,dtype"


@pytest.mark.parametrize(EXTEND_ARGS, EXTEND_CASES)
def test_extend(prefix_lens, extend_lens, num_q_heads, num_kv_heads, head_dim, dtype):
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pool = _Pool(lens, num_kv_heads, head_dim, dtype, seed=sum(lens))
    q = pool.randn(sum(extend_lens), num_q_heads, head_dim, dtype=dtype)
    args = (
        q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(prefix_lens),
        torch.tensor(extend_lens), 1 / math.sqrt(head_dim),
    )  # fmt: skip
    _check(triton_ops.extend_attention(*args), reference.extend_attention(*args), dtype)


def _random_tree_mask(batch: int, num_draft: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self masks of random trees (node i's parent is a node before it)."""
    masks = torch.zeros(batch, num_draft, num_draft, dtype=torch.bool)
    for b in range(batch):
        for i in range(num_draft):
            masks[b, i, i] = True
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                masks[b, i] |= masks[b, parent]
    return masks


TREE_CASES = [
    # prefix_lens, num_draft, Hq, Hkv, D, dtype
    ([0, 90, 13], 4, 3, 1, 64, F32),
    ([150], 20, 8, 1, 128, BF16),
    ([5, 70], 1, 4, 4, 80, F32),
    ([33, 1], 7, 4, 1, 96, F16),
]


TREE_ARGS = "prefix_lens,num_draft,num_q_heads,num_kv_heads,head_dim,dtype"


@pytest.mark.parametrize(TREE_ARGS, TREE_CASES)
def test_tree_verify(prefix_lens, num_draft, num_q_heads, num_kv_heads, head_dim, dtype):
    lens = [p + num_draft for p in prefix_lens]
    pool = _Pool(lens, num_kv_heads, head_dim, dtype, seed=num_draft)
    q = pool.randn(len(lens) * num_draft, num_q_heads, head_dim, dtype=dtype)
    tree_mask = _random_tree_mask(len(lens), num_draft, pool.gen)
    args = (
        q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(prefix_lens), tree_mask,
        1 / math.sqrt(head_dim),
    )  # fmt: skip
    out = triton_ops.tree_verify_attention(*args)
    _check(out, reference.tree_verify_attention(*args), dtype)


@pytest.mark.parametrize("dtype,num_heads,head_dim", [(F32, 3, 80), (BF16, 1, 64), (F16, 2, 96)])
def test_store_kv_writes_exactly_its_slots(dtype, num_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    k_pool = torch.full((40, num_heads, head_dim), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()
    slots = torch.randperm(39, generator=gen)[:11] + 1
    # k, v as strided views of a fused qkv buffer, in fp32 (the kernel casts).
    qkv = torch.randn(11, 3, num_heads, head_dim, generator=gen)
    k, v = qkv[:, 1], qkv[:, 2]
    triton_ops.store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[slots], k.to(dtype)) and torch.equal(v_pool[slots], v.to(dtype))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all()


@pytest.mark.parametrize("vocab,extra_words", [(1, 0), (33, 0), (1000, 2), (2049, 0)])
def test_bitmask_equals_reference(vocab, extra_words):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2, 0] = 0  # first 32 banned
    logits = torch.randn(3, vocab, generator=gen)
    want = logits.clone()
    reference.apply_token_bitmask_(want, bitmask)
    triton_ops.apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, want)
    assert torch.isneginf(logits).any() and torch.isfinite(logits[1]).all()


# Quantized pools (int8, fp8 e4m3 / e5m2: codes and a float32 scale per slot and kv head):
# the kernels read code * scale as the references do, with fp8 widened from its bytes.
QUANT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _quantized_pool(pool: _Pool, dtype: torch.dtype):
    from sglang_like_kernels import kv_quant

    # rows of very different magnitudes, as K after RoPE and V of different layers are
    rows = torch.logspace(-2, 1, pool.k.shape[0])[:, None, None]
    (k, ks), (v, vs) = (kv_quant.quantize(pool.k * rows, dtype),
                        kv_quant.quantize(pool.v * rows.flip(0), dtype))
    return k, v, {"k_scale": ks, "v_scale": vs}


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("window,softcap", [(None, None), (50, 30.0)])
def test_quantized_pools_in_decode_extend_and_verify(dtype, window, softcap):
    kw = {"window": window, "softcap": softcap}
    lens = [1, 140, 70]
    pool = _Pool(lens, 2, 64, F32, seed=3)
    k, v, scales = _quantized_pool(pool, dtype)
    q = pool.randn(3, 6, 64, dtype=F32)
    args = (q, k, v, pool.table, pool.rows, torch.tensor(lens), 0.125)
    _check(triton_ops.decode_attention(*args, num_splits=3, split_min=1, **scales, **kw),
           reference.decode_attention(*args, **scales, **kw), F32)
    prefix, extend = [0, 100, 30], [1, 40, 40]
    qe = pool.randn(81, 6, 64, dtype=F32)
    args = (qe, k, v, pool.table, pool.rows, torch.tensor(prefix), torch.tensor(extend), 0.125)
    _check(triton_ops.extend_attention(*args, **scales, **kw),
           reference.extend_attention(*args, **scales, **kw), F32)
    tree = _random_tree_mask(3, 5, pool.gen)
    qt = pool.randn(15, 6, 64, dtype=F32)
    args = (qt, k, v, pool.table, pool.rows, torch.tensor([0, 120, 60]), tree, 0.125)
    _check(triton_ops.tree_verify_attention(*args, **scales, **kw),
           reference.tree_verify_attention(*args, **scales, **kw), F32)
    with pytest.raises(ValueError, match="needs its scales"):
        triton_ops.decode_attention(q, k, v, pool.table, pool.rows, torch.tensor(lens), 0.125)


@pytest.mark.parametrize("dtype", QUANT)
def test_store_kv_into_a_quantized_pool_is_the_references_codes(dtype):
    from sglang_like_kernels import kv_quant

    gen = torch.Generator().manual_seed(7)
    pools = [torch.zeros(40, 2, 64, dtype=dtype) for _ in range(4)]
    scales = [torch.full((40, 2), float("nan")) for _ in range(4)]
    slots = torch.randperm(39, generator=gen)[:11] + 1
    qkv = torch.randn(11, 3, 2, 64, generator=gen) * 5
    triton_ops.store_kv(pools[0], pools[1], slots, qkv[:, 1], qkv[:, 2], scales[0], scales[1])
    reference.store_kv(pools[2], pools[3], slots, qkv[:, 1], qkv[:, 2], scales[2], scales[3])
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(kv_quant.as_bytes(pools[a]), kv_quant.as_bytes(pools[b]))
        assert torch.equal(scales[a][slots], scales[b][slots])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert scales[0][untouched].isnan().all()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("tokens,rank,k,n", [(5, 8, 96, 80), (3, 40, 130, 200), (1, 4, 64, 64)])
def test_lora_delta_equals_reference(dtype, tokens, rank, k, n):
    """The LoRA shrink/expand kernels: every row's delta from its own adapter (slot -1
    rows untouched), ranks padded past an adapter's own with zeros, K and N not multiples
    of the blocks."""
    gen = torch.Generator().manual_seed(tokens * 1000 + rank)
    num_adapters = 3
    a = torch.randn(num_adapters, rank, k, generator=gen).to(dtype)
    b = torch.randn(num_adapters, n, rank, generator=gen).to(dtype)
    a[1, rank // 2:] = 0  # adapter 1 of half the rank, as the stacking pads it
    b[1, :, rank // 2:] = 0
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    slots = torch.tensor([(-1, 0, 2, 1, 0)[i % 5] for i in range(tokens)])
    y0 = torch.randn(tokens, n, generator=gen).to(dtype)
    want, got = y0.clone(), y0.clone()
    reference.lora_delta_(want, x, slots, a, b)
    triton_ops.lora_delta_(got, x, slots, a, b)
    untouched = slots < 0
    assert torch.equal(got[untouched], y0[untouched])
    # sums of K and R products: the bound is relative to the largest output (an element
    # near zero differs by the rounding of the large terms it sums)
    assert not got.isnan().any() and got.dtype == dtype
    tol = 1e-5 if dtype == F32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def _routing(tokens: int, num_experts: int, top_k: int, hot: int | None, cold: list[int],
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], ids int64 [T, top_k]): a random top-k routing in which
    expert `hot` is every token's choice and the `cold` experts are nobody's."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    if hot is not None:
        scores[:, hot] = 2.0
    scores[:, cold] = -1.0
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights, ids


MOE_CASES = [
    # tokens, experts, top_k, hidden, inter, dtype, hot expert, cold experts
    (1, 64, 8, 64, 32, BF16, None, []),  # one token: 8 blocks of one row, 56 experts idle
    (37, 8, 2, 80, 40, F32, 3, [0, 5]),  # T and H, 2I off the blocks; a hot and idle experts
    (20, 4, 1, 64, 48, F16, None, [2]),  # top_k 1
    (100, 4, 2, 48, 16, BF16, 0, []),  # 50 rows an expert: BLOCK_M 64, the hot one's 100
    (5, 8, 8, 32, 24, F32, None, []),  # top_k = E: every expert gets every token
    (3, 64, 2, 96, 64, F32, 63, list(range(32))),  # half the experts idle, the last hot
]


@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter,dtype,hot,cold", MOE_CASES)
def test_fused_moe_equals_reference(tokens, num_experts, top_k, hidden, inter, dtype, hot,
                                    cold):
    gen = torch.Generator().manual_seed(tokens * 100 + num_experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
    weights, ids = _routing(tokens, num_experts, top_k, hot, cold, gen)
    if hot is not None:
        assert (ids == hot).any(dim=1).all()
    assert not torch.isin(ids, torch.tensor(cold, dtype=ids.dtype)).any()
    activation = "gelu_tanh" if dtype == F16 else "silu"
    got = triton_ops.fused_moe(x, w_gate_up, w_down, weights, ids, activation)
    want = reference.fused_moe_ref(x, w_gate_up, w_down, weights, ids, activation)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert not got.isnan().any(), "a pair's row was never written"
    # Sums of products with 16-bit roundings on the way (the reference rounds gate/up, the
    # activation and the down output; the kernel rounds its gate/up store, by truncation
    # under the interpreter: up to one ulp, 2^-7 for bf16): the bound is relative to the
    # largest output, since an element near zero differs by the rounding of the large terms
    # it sums. fp32: float32 sums in a different order only.
    tol = {F32: 1e-5, F16: 4e-3, BF16: 2e-2}[dtype]
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_fused_moe_drops_what_routing_weights_zero():
    """The routing weight multiplies each pair's row: a zero weight removes that expert's
    output exactly (a kernel that ignored the weights, or scaled the wrong row, fails)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen)
    w_gate_up = torch.randn(4, 64, 64, generator=gen) / 8
    w_down = torch.randn(4, 64, 32, generator=gen) / 6
    weights, ids = _routing(9, 4, 2, None, [], gen)
    weights[:, 1] = 0.0
    got = triton_ops.fused_moe(x, w_gate_up, w_down, weights, ids)
    want = reference.fused_moe_ref(x, w_gate_up, w_down, weights[:, :1], ids[:, :1])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _sparse_moe(num_experts: int, top_k: int, hidden: int, inter: int, quant_name: str,
                dtype: torch.dtype, gen: torch.Generator):
    """A layers.moe.SparseMoE with random experts loaded through their linears."""
    from types import SimpleNamespace

    from sglang_like.layers.decoder import DecoderLayerDescription
    from sglang_like.layers.moe import SparseMoE
    from sglang_like.layers.quantization import QuantConfig

    config = SimpleNamespace(hidden_size=hidden, num_experts=num_experts,
                             num_experts_per_tok=top_k, norm_topk_prob=True,
                             moe_intermediate_size=inter, shared_expert_intermediate_size=0)
    moe = SparseMoE(config, DecoderLayerDescription(), QuantConfig(quant_name, dtype))
    weights = {}
    for j in range(num_experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            weights[f"e{j}.{name}.weight"] = torch.randn(shape, generator=gen) / shape[1]**0.5
    for j, expert in enumerate(moe.experts):
        for lin in (expert.gate_up_proj, expert.down_proj):
            lin.load_weights(weights, f"e{j}.", torch.device("cpu"))
    return moe


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_sparse_moe_fused_path_equals_its_loop(dtype):
    """layers.moe's CUDA path (SparseMoE._fused_experts_forward, run here on CPU tensors
    under the interpreter) equals its per-expert loop; after it the experts' weights are
    views of the stacks (one copy), and a reload is stacked again."""
    gen = torch.Generator().manual_seed(11)
    moe = _sparse_moe(8, 2, 64, 32, "none", dtype, gen)
    x = torch.randn(13, 64, generator=gen).to(dtype)
    weights, ids = _routing(13, 8, 2, 6, [1], gen)
    want = moe.experts_forward(x, weights, ids)  # on CPU: the loop
    got = moe._fused_experts_forward(x, weights, ids)
    tol = 1e-5 if dtype == F32 else 2e-2  # as in test_fused_moe_equals_reference
    assert (got - want).abs().max() <= tol * want.abs().max()
    gate_up, down = moe._dense_stacks
    assert gate_up.shape == (8, 64, 64) and down.shape == (8, 64, 32)
    # the oracle of the kernel tests is the layer's loop, bit for bit
    assert torch.equal(reference.fused_moe_ref(x, gate_up, down, weights, ids), want)
    for j, expert in enumerate(moe.experts):
        assert expert.gate_up_proj.weight.data_ptr() == gate_up[j].data_ptr()
        assert expert.down_proj.weight.data_ptr() == down[j].data_ptr()
    assert torch.equal(moe.experts_forward(x, weights, ids), want)  # the loop over the views
    for expert in moe.experts:  # what load_weights does: new buffers
        expert.gate_up_proj.register_buffer("weight", -expert.gate_up_proj.weight.clone())
    want = moe.experts_forward(x, weights, ids)
    got = moe._fused_experts_forward(x, weights, ids)
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_sparse_moe_fused_path_declines_quantized_experts_and_lora_batches():
    from sglang_like.layers.lora import LoraContext

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 64, generator=gen)
    weights, ids = _routing(4, 4, 2, None, [], gen)
    quantized = _sparse_moe(4, 2, 64, 32, "int8", F32, gen)
    assert quantized._fused_experts_forward(x, weights, ids) is None
    dense = _sparse_moe(4, 2, 64, 32, "none", F32, gen)
    ctx = LoraContext()
    ctx.batch = object()  # any batch: adapters may target the experts' linears
    for expert in dense.experts:
        expert.gate_up_proj.lora_ctx = expert.down_proj.lora_ctx = ctx
    assert dense._fused_experts_forward(x, weights, ids) is None
    ctx.batch = None
    assert dense._fused_experts_forward(x, weights, ids) is not None


def _ragged_masks(gen: torch.Generator) -> tuple[list[int], list[torch.Tensor], list[bool]]:
    """(prefix lens, masks, positional) of a mixed batch as the runtime builds them: a draft
    tree, a causal extend longer than a tile (rows and columns in several blocks), a draft
    step's rows over every node so far (fewer rows than columns), a request with no rows,
    and an extend whose middle rows see each other both ways (an image's, windowed by
    position)."""
    tree = _random_tree_mask(1, 6, gen)[0]
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    step = torch.zeros(3, 9, dtype=torch.bool)
    step[:, :6] = _random_tree_mask(1, 6, gen)[0][[1, 3, 5]]
    step[torch.arange(3), torch.arange(6, 9)] = True
    image = torch.ones(30, 30, dtype=torch.bool).tril()
    image[10:25, 10:25] = True
    masks = [tree, causal, step, torch.zeros(0, 4, dtype=torch.bool), image]
    return [40, 90, 0, 7, 25], masks, [False, False, False, False, True]


@pytest.mark.parametrize("dtype", [F32, BF16, torch.int8])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, 30.0), (75, None)])
def test_masked_attention_ragged(dtype, window, softcap):
    """Requests of different row and column counts, each under its own mask, in one launch:
    every row is the reference's (windows: the last `window` visible keys, or by position
    for the positional request)."""
    prefix, masks, positional = _ragged_masks(torch.Generator().manual_seed(5))
    lens = [p + m.shape[1] for p, m in zip(prefix, masks, strict=True)]
    pool = _Pool(lens, 2, 64, F32 if dtype == torch.int8 else dtype, seed=9)
    k, v, scales = (_quantized_pool(pool, dtype) if dtype == torch.int8
                    else (pool.k, pool.v, {}))
    q = pool.randn(sum(m.shape[0] for m in masks), 6, 64,
                   dtype=F32 if dtype == torch.int8 else dtype)
    args = (q, k, v, pool.table, pool.rows, torch.tensor(prefix), masks, 0.125)
    kw = {"window": window, "softcap": softcap, "positional": torch.tensor(positional),
          **scales}
    _check(triton_ops.masked_attention(*args, **kw), reference.masked_attention(*args, **kw),
           F32 if dtype == torch.int8 else dtype)


def test_masked_attention_takes_its_offsets_from_the_device():
    """A draft step's batch (every request k rows over d * k nodes, no positional rows) with
    its offsets precomputed (`masked_offsets`, what a CUDA graph of the draft depths passes)
    gives the rows it gives without them; offsets of another shape move every request's
    rows (a wrong depth's columns) and do not."""
    gen = torch.Generator().manual_seed(11)
    k, depth, prefix = 3, 2, [17, 0, 40]
    masks = [torch.cat([_random_tree_mask(1, 3, gen)[0], torch.eye(k, dtype=torch.bool)], 1)
             for _ in prefix]
    pool = _Pool([p + depth * k for p in prefix], 2, 64, F32, seed=4)
    q = pool.randn(len(prefix) * k, 4, 64, dtype=F32)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(prefix), masks, 0.125)
    want = reference.masked_attention(*args)
    shapes = ([k] * len(prefix), [depth * k] * len(prefix))
    got = triton_ops.masked_attention(
        *args, mask_meta=triton_ops.masked_offsets(*shapes, torch.device("cpu")))
    _check(got, want, F32)
    assert torch.equal(got, triton_ops.masked_attention(*args))
    wrong = triton_ops.masked_offsets([k] * 3, [(depth - 1) * k] * 3, torch.device("cpu"))
    assert not torch.allclose(triton_ops.masked_attention(*args, mask_meta=wrong), want,
                              atol=1e-3)


# Long prefixes split over several programs (tree verify, masked): a small split minimum
# makes prefixes of a few hundred keys take many splits, each request by its own length.
SPLIT_VARIANTS = [
    # pool dtype, window, softcap
    (F32, None, None),
    (BF16, None, None),
    (F32, 300, None),  # a window over several splits: rows start in different ones
    (F16, None, 30.0),
    (torch.int8, 300, 30.0),
    (torch.float8_e4m3fn, None, None),
    (torch.float8_e5m2, 300, 30.0),
]


def _split_pool(lens: list[int], num_kv_heads: int, dtype: torch.dtype, seed: int):
    """(pool, k, v, scales, q dtype) over a 1024-wide table (16 default splits at a
    split_min of 64 or less), quantized where dtype is a quantized pool's."""
    quantized = dtype in QUANT
    pool = _Pool(lens, num_kv_heads, 64, F32 if quantized else dtype, seed=seed,
                 max_context=1024)
    k, v, scales = _quantized_pool(pool, dtype) if quantized else (pool.k, pool.v, {})
    return pool, k, v, scales, F32 if quantized else dtype


@pytest.mark.parametrize("dtype,window,softcap", SPLIT_VARIANTS)
def test_tree_verify_splits_long_prefixes(dtype, window, softcap):
    """Prefixes of 700, 3, 260 and 0 keys in one batch: 11, 1, 5 and 1 splits of the 16
    (the draft keys in each request's last), merged into the reference's rows."""
    prefix = [700, 3, 260, 0]
    num_draft = 6
    pool, k, v, scales, q_dtype = _split_pool([p + num_draft for p in prefix], 2, dtype,
                                               seed=21)
    q = pool.randn(len(prefix) * num_draft, 4, 64, dtype=q_dtype)
    tree = _random_tree_mask(len(prefix), num_draft, pool.gen)
    args = (q, k, v, pool.table, pool.rows, torch.tensor(prefix), tree, 0.125)
    kw = {"window": window, "softcap": softcap, **scales}
    meta = triton_ops.tree_verify_meta(num_draft, 64, k.dtype, window=window, max_context=1024,
                                       num_programs=len(prefix) * 2, split_min=16)
    assert meta["NUM_SPLITS"] == 16
    _check(triton_ops.tree_verify_attention(*args, split_min=16, **kw),
           reference.tree_verify_attention(*args, **kw), q_dtype)


# the masked kernel's prefix loop is tree verify's (_attend_prefix); fewer variants keep
# the interpreter's time (the reduce alone is a program per row and head)
@pytest.mark.parametrize("dtype,window,softcap", [SPLIT_VARIANTS[i] for i in (0, 2, 4, 5)])
def test_masked_attention_splits_long_prefixes(dtype, window, softcap):
    """The ragged batch of test_masked_attention_ragged behind prefixes up to 600 keys, two
    row blocks of the causal extend each split too."""
    prefix, masks, positional = _ragged_masks(torch.Generator().manual_seed(6))
    prefix = [600, 290, 0, 7, 300]
    lens = [p + m.shape[1] for p, m in zip(prefix, masks, strict=True)]
    pool, k, v, scales, q_dtype = _split_pool(lens, 1, dtype, seed=22)
    q = pool.randn(sum(m.shape[0] for m in masks), 2, 64, dtype=q_dtype)
    args = (q, k, v, pool.table, pool.rows, torch.tensor(prefix), masks, 0.125)
    kw = {"window": window, "softcap": softcap, "positional": torch.tensor(positional),
          **scales}
    meta = triton_ops.masked_meta(64, k.dtype, window=window, max_context=1024,
                                  num_programs=len(masks) * 2 * 2, split_min=16)
    assert meta["NUM_SPLITS"] == 16
    _check(triton_ops.masked_attention(*args, split_min=16, **kw),
           reference.masked_attention(*args, **kw), q_dtype)


def test_verify_splits_follow_each_requests_prefix(monkeypatch):
    """As decode's: each request splits its own prefix in pieces of at least split_min
    (whole tiles), so a short prefix fills one partial of the NUM_SPLITS, a long one more;
    the others stay empty (-inf log-sum-exp) and the merge still gives the reference."""
    lse = []

    def recording_empty(shape, dtype, device):
        t = torch.full(shape, float("nan"), dtype=dtype, device=device)
        if tuple(shape) == (16, 4, 8):  # mid_lse [B*N, Hq, NUM_SPLITS]
            lse.append(t)
        return t

    monkeypatch.setattr(triton_ops, "_empty", recording_empty)
    prefix, num_draft = [5, 40, 300, 1000], 4
    pool = _Pool([p + num_draft for p in prefix], 2, 64, F32, seed=23, max_context=1024)
    q = pool.randn(len(prefix) * num_draft, 4, 64, dtype=F32)
    tree = _random_tree_mask(len(prefix), num_draft, pool.gen)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(prefix), tree, 0.125)
    out = triton_ops.tree_verify_attention(*args, num_splits=8, split_min=64)
    _check(out, reference.tree_verify_attention(*args), F32)
    used = (lse[0] > float("-inf")).sum(-1).view(len(prefix), num_draft, 4)
    assert triton_ops.tree_verify_meta(num_draft, 64, F32)["BLOCK_N"] == 64
    # 5, 40: one split; 300: pieces of 64 -> 5; 1000: pieces of 125 -> 128 -> 8
    for b, n in enumerate((1, 1, 5, 8)):
        assert (used[b] == n).all(), (b, used[b])


@pytest.mark.parametrize("max_context,window,batch,num_q_heads,want", [
    (200, None, 1, 32, 1),  # a table no longer than a split: one, written directly
    (4096, None, 1, 32, 16),  # batch 1 long context: every split
    (32768, 1000, 1, 32, 4),  # a window caps the prefix: cdiv(1000, 256) = 4
    (32768, None, 16, 32, 2),  # 512 programs already: 1024 // 512
    (32768, None, 8, 24, 4),  # 1024 // 192 = 5, down to a power of two
    (32768, None, 64, 32, 1),  # a big batch fills the GPU without splits
])
def test_verify_split_count_is_chosen_on_the_host(max_context, window, batch, num_q_heads,
                                                  want):
    meta = triton_ops.tree_verify_meta(16, 128, BF16, window=window, max_context=max_context,
                                       num_programs=batch * num_q_heads)
    assert meta["NUM_SPLITS"] == want and meta["BLOCK_S"] == want


def test_a_verify_program_takes_a_kv_heads_whole_group(monkeypatch):
    """Grouped query heads (8 over 2 kv heads, 6 drafts): a program per request, kv head and
    block of draft x head rows (24 here: one block of 32), so each kv head's keys are read
    once, not once per query head; the rows are still the reference's."""
    launches = []
    kernel = triton_ops.tk.tree_verify_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["HEADS"], kwargs["BLOCK_R"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_ops.tk, "tree_verify_kernel", Recording())
    prefix, num_draft = [30, 7, 90], 6
    pool = _Pool([p + num_draft for p in prefix], 2, 64, F32, seed=25, max_context=128)
    q = pool.randn(len(prefix) * num_draft, 8, 64, dtype=F32)
    tree = _random_tree_mask(len(prefix), num_draft, pool.gen)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor(prefix), tree, 0.125)
    _check(triton_ops.tree_verify_attention(*args, split_min=128),
           reference.tree_verify_attention(*args), F32)
    assert launches == [((3, 2, 1), 4, 32)]


def test_one_split_writes_the_output_without_partials(monkeypatch):
    """A table no wider than split_min: one split, no partial buffers, no reduce, and the
    kernel's own rows are the reference's."""
    shapes = []

    def recording_empty(shape, dtype, device):
        shapes.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_ops, "_empty", recording_empty)
    pool = _Pool([90, 20], 1, 64, F32, seed=24, max_context=128)
    q = pool.randn(2 * 3, 2, 64, dtype=F32)
    tree = _random_tree_mask(2, 3, pool.gen)
    args = (q, pool.k, pool.v, pool.table, pool.rows, torch.tensor([87, 17]), tree, 0.125)
    _check(triton_ops.tree_verify_attention(*args, split_min=128),
           reference.tree_verify_attention(*args), F32)
    assert shapes == [(6, 2, 64), (1,), (1,)]
