"""Tensor parallelism without processes: the sharding plan (uneven heads), GGUF block slicing,
the all-reduces, the batch broadcast's round trip, and a sharded tiny model (two ranks on two
threads) against the whole one."""

from __future__ import annotations

import threading
import time

import gguf
import numpy as np
import pytest
import torch

from sglang_like.config import ModelConfig
from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.quantization import GGUFBlockWeight
from sglang_like.mem_pool import KVPool
from sglang_like.model_loader.loaded import expected_weight_shapes
from sglang_like.models.llama import LlamaForCausalLM
from sglang_like.tp import (
    GroupAllReduce,
    ShmAllReduce,
    TPRankLost,
    TPShard,
    make_shard_plan,
    shard_weights,
)
from sglang_like.tp.broadcast import decode_batch, encode_batch
from sglang_like.tp.comm import make_process_group
from sglang_like_kernels import cpu as native_cpu

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True)


# ---- the plan ------------------------------------------------------------------------------
@pytest.mark.parametrize(("tp_size", "kv", "q", "inter"), [
    (1, [3], [9], [1536]),
    (2, [2, 1], [6, 3], [768, 768]),
    (3, [1, 1, 1], [3, 3, 3], [512, 512, 512]),
])
def test_plan_splits_by_kv_groups(tp_size: int, kv: list[int], q: list[int],
                                  inter: list[int]) -> None:
    plans = [make_shard_plan(SMOLLM2, tp_size, r) for r in range(tp_size)]
    assert [p.num_kv_heads for p in plans] == kv
    assert [p.num_heads for p in plans] == q
    assert [p.intermediate_size for p in plans] == inter
    # contiguous, covering, each query head with its KV head (3 queries per KV head)
    assert [p.kv_head_start for p in plans] == [sum(kv[:r]) for r in range(tp_size)]
    assert [p.q_head_start for p in plans] == [3 * p.kv_head_start for p in plans]
    assert [p.inter_start for p in plans] == [sum(inter[:r]) for r in range(tp_size)]
    assert all(p.intermediate_size % 64 == 0 for p in plans)
    assert [p.is_first for p in plans] == [True] + [False] * (tp_size - 1)


@pytest.mark.parametrize(("config", "tp_size", "match"), [
    (SMOLLM2, 4, "exceeds the model's 3 KV heads"),
    (SMOLLM2, 0, "tp_size must be >= 1"),
    (SMOLLM2.replace(intermediate_size=1000), 2, "cannot be split"),
])
def test_plan_rejects_what_cannot_split(config: ModelConfig, tp_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_shard_plan(config, tp_size, 0)


# ---- GGUF block slicing --------------------------------------------------------------------
def _block_matrix(qtype: str, rows: int, cols: int) -> GGUFBlockWeight:
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return GGUFBlockWeight(qtype, (rows, cols), blocks)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "cols"), [((0, 64), (0, 384)), ((64, 192), (192, 384)),
                                            ((3, 5), (32, 96))])
def test_sliced_blocks_dequantize_to_the_slice(qtype: str, rows: tuple[int, int],
                                               cols: tuple[int, int]) -> None:
    w = _block_matrix(qtype, 192, 384)
    full = w.dequantize()
    by_rows = w.slice_rows(*rows)
    assert by_rows.shape == (rows[1] - rows[0], 384)
    assert torch.equal(by_rows.dequantize(), full[rows[0] : rows[1]])
    by_cols = w.slice_cols(*cols)
    assert by_cols.shape == (192, cols[1] - cols[0])
    assert torch.equal(by_cols.dequantize(), full[:, cols[0] : cols[1]])
    if qtype != "Q8_0":  # the int4 repack of a slice is the slice of the repack
        codes, scale, zero = w.int4_groups()
        c, s, z = by_cols.int4_groups()
        g0, g1 = cols[0] // 32, cols[1] // 32
        assert torch.equal(c, codes[:, cols[0] : cols[1]])
        assert torch.equal(s, scale[:, g0:g1]) and torch.equal(z, zero[:, g0:g1])


def test_block_slicing_rejects_a_cut_inside_a_block() -> None:
    w = _block_matrix("Q4_1", 8, 128)
    with pytest.raises(ValueError, match="block boundaries"):
        w.slice_cols(16, 128)
    with pytest.raises(ValueError, match="outside"):
        w.slice_rows(4, 9)


# ---- the all-reduces -----------------------------------------------------------------------
def _on_threads(fn, num: int) -> list:  # noqa: ANN001
    results: list = [None] * num
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tp_size", [2, 3])
def test_shm_all_reduce_sums_identically_on_every_rank(tmp_path, tp_size: int) -> None:
    path = str(tmp_path / "shm")
    slot_bytes = 4096  # small: the [300, 7] tensors need several rounds
    ShmAllReduce.create_file(path, tp_size, slot_bytes)
    inputs = [[torch.randn(shape, generator=torch.Generator().manual_seed(10 * r + i))
               for i, shape in enumerate([(1, 5), (300, 7), (2, 3)])] for r in range(tp_size)]

    def rank_main(rank: int) -> list[torch.Tensor]:
        comm = ShmAllReduce(path, rank, tp_size, slot_bytes, lambda: None, 30)
        out = [comm.all_reduce(x.clone()) for x in inputs[rank]]
        comm.close()
        return out

    results = _on_threads(rank_main, tp_size)
    for i in range(3):
        expected = inputs[0][i].clone()
        for r in range(1, tp_size):
            expected += inputs[r][i]
        for r in range(tp_size):
            assert torch.equal(results[r][i], expected)


def test_shm_all_reduce_equals_gloo() -> None:
    store = torch.distributed.HashStore()
    xs = [torch.randn(4, 576, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def rank_main(rank: int) -> torch.Tensor:
        group = make_process_group(torch.distributed.PrefixStore("t", store), rank, 2,
                                   torch.device("cpu"), 30)
        return GroupAllReduce(group, lambda: None).all_reduce(xs[rank].clone())

    gloo = _on_threads(rank_main, 2)
    assert torch.equal(gloo[0], xs[0] + xs[1]) and torch.equal(gloo[1], xs[0] + xs[1])


def test_a_lost_peer_raises_instead_of_hanging(tmp_path) -> None:
    path = str(tmp_path / "shm")
    ShmAllReduce.create_file(path, 2, 4096)
    since = time.monotonic()
    comm = ShmAllReduce(path, 0, 2, 4096, lambda: "rank 1 exited with code -9"
                        if time.monotonic() - since > 0.2 else None, timeout_s=60)
    with pytest.raises(TPRankLost, match="rank 1 exited"):
        comm.all_reduce(torch.ones(3))
    assert time.monotonic() - since < 5
    stuck = ShmAllReduce(path, 0, 2, 4096, lambda: None, timeout_s=0.3)
    with pytest.raises(TPRankLost, match="within 0.3 s"):
        stuck.all_reduce(torch.ones(3))


# ---- the broadcast -------------------------------------------------------------------------
def _batch(kind: str) -> ForwardBatch:
    table = torch.arange(5 * 40, dtype=torch.int32).view(5, 40)
    prefix, extend = torch.tensor([7, 0, 12]), torch.tensor([3, 4, 3])
    if kind == "decode":
        extend = torch.ones(3, dtype=torch.long)
    num = int(extend.sum())
    masks = tree = None
    if kind == "custom":
        masks = [torch.rand(int(n), int(n) + 1, generator=torch.Generator().manual_seed(int(n)))
                 > 0.5 for n in extend]
    if kind == "tree":
        tree = torch.rand(3, 3, 3) > 0.5
    return ForwardBatch(
        input_ids=torch.arange(num) + 100, positions=torch.arange(num) * 2,
        out_slots=torch.arange(num) + 1000, req_pool_indices=torch.tensor([4, 1, 2]),
        prefix_lens=prefix, extend_lens=extend, logits_indices=torch.tensor([0]),
        req_to_token=table, tree_mask=tree, custom_masks=masks, is_decode=kind == "decode")


@pytest.mark.parametrize("kind", ["extend", "decode", "custom", "tree"])
def test_batch_round_trip(kind: str) -> None:
    fb = _batch(kind)
    got = decode_batch([bytes(f) for f in encode_batch(fb)], torch.device("cpu"))
    for name in ("input_ids", "positions", "out_slots", "prefix_lens", "extend_lens",
                 "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(fb, name)), name
    assert got.is_decode == fb.is_decode
    assert torch.equal(got.req_pool_indices, torch.arange(3))
    width = got.req_to_token.shape[1]
    key_lens = fb.seq_lens + (1 if kind == "custom" else 0)
    assert width == int(key_lens.max())
    assert torch.equal(got.req_to_token, fb.req_to_token[fb.req_pool_indices, :width])
    if kind == "custom":
        assert all(torch.equal(a, b) for a, b in zip(got.custom_masks, fb.custom_masks,
                                                       strict=True))
    else:
        assert got.custom_masks is None
    assert (got.tree_mask is None) == (fb.tree_mask is None)
    if kind == "tree":
        assert torch.equal(got.tree_mask, fb.tree_mask)


# ---- a sharded tiny model equals the whole one ---------------------------------------------
TINY = ModelConfig("llama", 97, 64, 256, 2, 6, 3, 16, attention_bias=True,
                   max_position_embeddings=64)


def _tiny_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = expected_weight_shapes(config)
    for i in range(config.num_hidden_layers):  # Llama's attention_bias covers o_proj too
        shapes[f"model.layers.{i}.self_attn.o_proj.bias"] = (config.hidden_size,)
    return {name: torch.randn(shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0)
            for name, shape in shapes.items()}


def _run(model: LlamaForCausalLM, config: ModelConfig, num_kv_heads: int) -> torch.Tensor:
    """Logits of a 5-token prefill then a 1-token decode (the decode reads the prefill's K/V)."""
    pool = KVPool(16, config.num_hidden_layers, num_kv_heads, config.head_dim, torch.float32,
                  "cpu")
    table = torch.zeros(1, 32, dtype=torch.int32)
    table[0, :6] = torch.arange(1, 7)
    logits = []
    for ids, start in (([5, 17, 3, 90, 41], 0), ([8], 5)):
        n = len(ids)
        fb = ForwardBatch(torch.tensor(ids), torch.arange(start, start + n),
                          torch.arange(start + 1, start + n + 1), torch.tensor([0]),
                          torch.tensor([start]), torch.tensor([n]), torch.arange(n), table,
                          is_decode=n == 1)
        logits.append(model(fb, pool))
    return torch.cat(logits)


def test_two_shards_compute_the_whole_model(tmp_path) -> None:
    weights = _tiny_weights(TINY)
    whole = LlamaForCausalLM(TINY)
    whole.set_rope(64, "cpu")
    whole.load_weights(weights, torch.device("cpu"))
    expected = _run(whole, TINY, TINY.num_key_value_heads)
    path = str(tmp_path / "shm")
    ShmAllReduce.create_file(path, 2, 1 << 16)

    def rank_main(rank: int) -> torch.Tensor:
        comm = ShmAllReduce(path, rank, 2, 1 << 16, lambda: None, 30)
        plan = make_shard_plan(TINY, 2, rank)
        model = LlamaForCausalLM(TINY, tp=TPShard(plan, comm.all_reduce))
        model.set_rope(64, "cpu")
        model.load_weights(shard_weights(weights, TINY, plan), torch.device("cpu"))
        return _run(model, TINY, plan.num_kv_heads)

    got = _on_threads(rank_main, 2)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], got[1])  # the replicated residual stream: the same bits


def test_shard_weights_drops_row_parallel_bias_off_rank_0() -> None:
    weights = _tiny_weights(TINY)
    first, second = (shard_weights(weights, TINY, make_shard_plan(TINY, 2, r)) for r in (0, 1))
    name = "model.layers.0.self_attn.o_proj.bias"
    assert name in first and name not in second
    assert first["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert second["model.layers.0.self_attn.k_proj.bias"].shape == (16,)
    assert second["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert torch.equal(second["model.layers.1.mlp.down_proj.weight"],
                       weights["model.layers.1.mlp.down_proj.weight"][:, 128:])
    assert first["model.embed_tokens.weight"] is weights["model.embed_tokens.weight"]



# ---- GGUF types (K-quants) shard at their blocks ----------------------------------------------
KQ_TINY = ModelConfig("llama", 96, 256, 1024, 2, 4, 2, 64, max_position_embeddings=64)
# a K-quant mix as llama-quantize makes one: K types where a row is 256-aligned; o_proj (its
# 128-column shards cannot cut a 256 super-block) as the legacy 32-block type it falls back to
KQ_TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_0",
            "gate_proj": "Q5_K", "up_proj": "Q5_K", "down_proj": "Q4_K"}


@pytest.mark.skipif(not native_cpu.available(), reason="native CPU kernels not built")
def test_two_shards_of_a_k_quant_model_compute_the_whole_one(tmp_path) -> None:
    """Column-parallel shards cut rows, row-parallel ones cut columns at block boundaries (256
    for K types): every rank multiplies the file's own codes on kquants.c, and the two ranks
    together give the whole model's logits (to float summation order: the row-parallel
    partial sums are all-reduced)."""
    from sglang_like.layers.quantization import QuantConfig

    from ..gguf_quantize import quantize

    dense = _tiny_weights(KQ_TINY)
    weights: dict = {}
    for name, w in dense.items():
        part = name.split(".")[-2]
        if part in KQ_TYPES and name.endswith(".weight"):
            qtype = KQ_TYPES[part]
            weights[name] = GGUFBlockWeight(qtype, tuple(w.shape), quantize(w.numpy(), qtype))
        else:
            weights[name] = w
    quant = QuantConfig("gguf", torch.float32)
    whole = LlamaForCausalLM(KQ_TINY, quant)
    whole.set_rope(64, "cpu")
    whole.load_weights(weights, torch.device("cpu"))
    down = whole.model.layers[0].mlp.down_proj
    assert [k for k, _, _ in down.kq_runs] == ["q4m"]
    expected = _run(whole, KQ_TINY, KQ_TINY.num_key_value_heads)
    path = str(tmp_path / "shm")
    ShmAllReduce.create_file(path, 2, 1 << 16)

    def rank_main(rank: int) -> torch.Tensor:
        comm = ShmAllReduce(path, rank, 2, 1 << 16, lambda: None, 30)
        plan = make_shard_plan(KQ_TINY, 2, rank)
        model = LlamaForCausalLM(KQ_TINY, quant, tp=TPShard(plan, comm.all_reduce))
        model.set_rope(64, "cpu")
        sharded = shard_weights(weights, KQ_TINY, plan)
        assert sharded["model.layers.0.mlp.down_proj.weight"].shape == (256, 512)
        model.load_weights(sharded, torch.device("cpu"))
        return _run(model, KQ_TINY, plan.num_kv_heads)

    got = _on_threads(rank_main, 2)
    torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[0], got[1])
    # a shard that would cut a super-block is refused, naming the boundary
    with pytest.raises(ValueError, match="256-column block boundaries"):
        weights["model.layers.0.mlp.down_proj.weight"].slice_cols(0, 128)
