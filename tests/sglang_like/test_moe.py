"""Mixture-of-experts layers (layers/moe.py, kernels/.../cpu/moe.c).

- The router of every MoE family picks transformers' experts on prefill (fp32, tiny seeded
  models from transformers' own config classes; greedy equality is test_model_families').
- The experts' native call (moe.c: every chosen expert once over its rows) against a plain
  loop over (token, expert) pairs through the same linears, on random routings with an expert
  that gets no token and one that gets every token, for each packed kind it runs (x16 int4
  where the CPU has it, GGUF Q8_0 / Q4_K / Q6_K); a token's output is the same bits alone and
  in a batch.
- An MoE model through the engine's other paths: n-gram speculation, a radix-cache hit,
  a JSON grammar, chunked prefill.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

import sglang_like_kernels.cpu
from benchmarks.tiny_families import MOE_FAMILIES, PROMPTS, build_folder
from sglang_like.config import ModelConfig
from sglang_like.layers.decoder import DecoderLayerDescription
from sglang_like.layers.moe import SparseMoE, route
from sglang_like.layers.quantization import GGUFBlockWeight, QuantConfig

from ..gguf_quantize import quantize
from .test_hf_archs import tokenizer_json  # noqa: F401
from .test_model_families import _engine

transformers = pytest.importorskip("transformers")
native = pytest.mark.skipif(not sglang_like_kernels.cpu.available(),
                            reason="the native CPU kernels are not built on this machine")


@pytest.mark.parametrize("family", MOE_FAMILIES, ids=[f.name for f in MOE_FAMILIES])
def test_router_picks_transformers_experts_on_prefill(family: Any, tmp_path: Any,
                                                      tokenizer_json: Any) -> None:  # noqa: F811
    hf = build_folder(family, tmp_path, tokenizer_json)
    engine = _engine(str(tmp_path), quantization="none", disable_radix_cache=True)
    try:
        ours: dict[int, list[torch.Tensor]] = {}
        theirs: dict[int, list[torch.Tensor]] = {}
        layers = engine.runner.model.model.layers
        hooks = []
        for i, layer in enumerate(layers):
            if isinstance(layer.mlp, SparseMoE):
                moe = layer.mlp
                hooks.append(moe.gate.register_forward_hook(
                    lambda m, a, out, i=i, moe=moe: ours.setdefault(i, []).append(
                        route(out, moe.top_k, moe.renormalize)[1])))
                hooks.append(hf.model.layers[i].mlp.gate.register_forward_hook(
                    lambda m, a, out, i=i: theirs.setdefault(i, []).append(out[2])))
        assert hooks, "no sparse layer"
        for prompt in PROMPTS:
            ids = engine.tokenizer.encode(prompt)
            engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1,
                                                              "temperature": 0})
            with torch.no_grad():
                hf(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        for i in theirs:
            got = torch.cat([t.reshape(-1, t.shape[-1]) for t in ours[i]])
            want = torch.cat([t.reshape(-1, t.shape[-1]) for t in theirs[i]])
            assert got.shape == want.shape and got.shape[0] > 30
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"layer {i}"
            assert len(torch.unique(want)) > 2  # the tokens spread over experts
    finally:
        engine.shutdown()


H, INTER, E, TOP_K = 256, 256, 8, 2


def _moe(quant: str, qtype: str | None, shared: int = 0) -> SparseMoE:
    """A random SparseMoE (H x INTER experts, E of them; with `shared`, Qwen2-MoE's shared
    expert of that width and its gate) whose experts are `qtype` GGUF blocks (quant "gguf")
    or dense weights the method packs (quant "int4")."""
    config = ModelConfig(architecture="qwen2_moe" if shared else "qwen3_moe", vocab_size=16,
                         hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
                         norm_topk_prob=True, shared_expert_intermediate_size=shared)
    moe = SparseMoE(config, DecoderLayerDescription(mlp="moe"),
                    QuantConfig(quant, torch.float32))
    gen = torch.Generator().manual_seed(7)
    weights: dict[str, Any] = {}
    experts = [(f"experts.{j}.", INTER, e) for j, e in enumerate(moe.experts)]
    if shared:
        experts.append(("shared_expert.", shared, moe.shared_expert))
    for prefix, inter, _ in experts:
        for name, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)),
                            ("down_proj", (H, inter))):
            w = torch.randn(*shape, generator=gen) * 0.05
            weights[f"{prefix}{name}.weight"] = (
                w if qtype is None
                else GGUFBlockWeight(qtype, shape, quantize(w.numpy().astype(np.float32), qtype)))
    for prefix, _, expert in experts:
        for lin in (expert.gate_up_proj, expert.down_proj):
            lin.load_weights(weights, prefix, torch.device("cpu"))
    moe.gate.weight.data = torch.randn(E, H, generator=gen)
    if shared:
        moe.shared_expert_gate.weight.data = torch.randn(1, H, generator=gen) * 0.1
    return moe


def _pairwise(moe: SparseMoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
              ) -> torch.Tensor:
    """The experts' sum one (token, expert) pair at a time, in expert order per token."""
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in sorted(range(ids.shape[1]), key=lambda k: int(ids[t, k])):
            out[t] += moe.experts[int(ids[t, k])](x[t:t + 1]).float()[0] * w[t, k]
    return out


# int8: dense weights that Q8ExpertMethod rounds to Q8_0 blocks (QuantConfig.expert_method)
KINDS = [("gguf", "Q8_0"), ("gguf", "Q4_K"), ("gguf", "Q6_K"), ("int4", None), ("int8", None)]


@native
@pytest.mark.parametrize(("quant", "qtype"), KINDS, ids=[q or m for m, q in KINDS])
def test_native_experts_equal_a_pairwise_loop(quant: str, qtype: str | None) -> None:
    moe = _moe(quant, qtype)
    layer = moe.native_layer()
    assert layer is not None  # x16 int4 and the GGUF kinds run wherever the kernels are built
    forward = sglang_like_kernels.cpu.ops.moe_forward
    gen = torch.Generator().manual_seed(3)
    for T in (1, 5, 37):
        x = torch.randn(T, H, generator=gen)
        w, ids = route(moe.gate(x), TOP_K, True)
        _, got_ids, got_w = forward(x, layer)  # its own routing: the router's choice
        assert torch.equal(got_ids, ids.sort(-1).values)
        # the router's logits: the native kernel's float32 sums against torch's GEMM, whose
        # blocking differs by machine (37 rows on an AMD EPYC: weights 1.8e-6 apart)
        assert torch.allclose(got_w, w.gather(1, ids.argsort(-1)), atol=5e-6)
        if T > 1:
            ids = ids.clone()
            ids[:, 0] = 3  # expert 3 gets every token
            ids[:, 1] = torch.where(ids[:, 1] == 3, torch.full_like(ids[:, 1], 0), ids[:, 1])
            ids[ids == 5] = 6  # expert 5 gets none
        out, _, _ = forward(x, layer, (ids, w))
        want = _pairwise(moe, x, w, ids)
        bound = 1e-5 * want.abs().max().item()
        assert (out - want).abs().max().item() <= bound, T
        if T == 1:  # the layer itself takes the native path
            assert (moe(x) - want).abs().max().item() <= bound
        # a token alone gives the same bits as in the batch
        for t in (0, T - 1):
            alone, _, _ = forward(x[t:t + 1], layer, (ids[t:t + 1], w[t:t + 1]))
            assert torch.equal(alone[0], out[t])


@native
@pytest.mark.parametrize(("quant", "qtype"), [("gguf", "Q4_K"), ("int4", None)],
                         ids=["Q4_K", "int4"])
def test_native_shared_expert_equals_the_torch_formula(quant: str, qtype: str | None) -> None:
    """Qwen2-MoE's shared expert runs inside moe.c (the fused step takes such layers): the
    routed experts' sum plus sigmoid(gate . x) times the shared expert, as layers/moe.py's
    torch path adds them; a token alone gives the same bits as in a batch, on both sides of
    the tile kernels' row threshold."""
    moe = _moe(quant, qtype, shared=512)
    layer = moe.native_layer()
    assert layer is not None and int(layer[sglang_like_kernels.cpu.ops.MOE_FIELDS - 4]) == 512
    gen = torch.Generator().manual_seed(5)
    for T in (1, 6, 40):
        x = torch.randn(T, H, generator=gen)
        out = moe(x)  # the native path, shared expert included
        w, ids = route(moe.gate(x), TOP_K, True)
        want = _pairwise(moe, x, w, ids) + (torch.sigmoid(moe.shared_expert_gate(x))
                                            * moe.shared_expert(x).float())
        assert (out - want).abs().max().item() <= 1e-5 * want.abs().max().item(), T
        moe.native = False  # the torch path: experts looped, the shared expert added after
        assert (moe(x) - want).abs().max().item() <= 1e-5 * want.abs().max().item(), T
        moe.native = True
        for t in (0, T - 1):
            assert torch.equal(moe(x[t:t + 1])[0], out[t])


@native
def test_bad_expert_ids_are_refused() -> None:
    moe = _moe("gguf", "Q8_0")
    x = torch.randn(2, H)
    w = torch.full((2, TOP_K), 0.5)
    with pytest.raises(ValueError, match="expert ids"):
        sglang_like_kernels.cpu.ops.moe_forward(x, moe.native_layer(),
                                                (torch.tensor([[0, E], [1, 2]]), w))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: Any, tokenizer_json: Any) -> str:  # noqa: F811
    folder = tmp_path_factory.mktemp("qwen3-moe")
    build_folder(MOE_FAMILIES[0], folder, tokenizer_json)
    return str(folder)


GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_moe_model_composes_with_speculation_cache_chunks(qwen3_moe: str) -> None:
    """fp32: n-gram speculation (verify batches through the MoE layers), prefill in chunks
    and a radix hit give the plain run's greedy tokens."""
    plain = _engine(qwen3_moe, quantization="none", disable_radix_cache=True)
    try:
        want = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.shutdown()
    spec = _engine(qwen3_moe, quantization="none", speculative_algorithm="NGRAM",
                   chunked_prefill_size=7)
    try:
        assert [o["output_ids"] for o in spec.generate(PROMPTS, GREEDY)] == want
        again = spec.generate(PROMPTS[0], GREEDY)
        assert again["output_ids"] == want[0]
        assert again["meta_info"]["cached_tokens"] > 0
    finally:
        spec.shutdown()


def test_moe_model_holds_a_json_grammar(qwen3_moe: str) -> None:
    engine = _engine(qwen3_moe, quantization="int4")
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"], "additionalProperties": False}
        out = engine.generate(PROMPTS[2], {"max_new_tokens": 32, "temperature": 0.8,
                                           "json_schema": json.dumps(schema)})
        assert isinstance(json.loads(out["text"])["a"], int)
    finally:
        engine.shutdown()


def test_tensor_parallel_moe_equals_one_rank(tmp_path: Any, tokenizer_json: Any  # noqa: F811
                                             ) -> None:
    """TP=2 splits every expert's columns (and the shared expert's, and the dense layer's):
    fp32 greedy equals TP=1, or parts from it only where TP=1's top two were within 1e-3
    nats (the ranks add the same products in another order)."""
    family = next(f for f in MOE_FAMILIES if f.name == "qwen2-moe")
    family = family._replace(config=family.config | {
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})
    build_folder(family, tmp_path, tokenizer_json)
    sp = {**GREEDY, "max_new_tokens": 16}
    one = _engine(str(tmp_path), quantization="none")
    try:
        want = one.generate(PROMPTS, sp, return_logprob=True, top_logprobs_num=2)
    finally:
        one.shutdown()
    two = _engine(str(tmp_path), quantization="none", tp_size=2)
    try:
        assert two.runner.model.model.layers[0].mlp.experts[0].intermediate_size == 64
        got = two.generate(PROMPTS, sp)
    finally:
        two.shutdown()
    for w, g in zip(want, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(w["output_ids"], g["output_ids"],
                                                       strict=True)) if a != b), None)
        if first is not None:
            top = w["meta_info"]["output_top_logprobs"][first]
            assert top[0][0] - top[1][0] < 1e-3, (first, top)


def test_lora_on_experts_is_refused_attention_is_read(tmp_path: Any) -> None:
    """An adapter of a sparse layer's MLP would have no linear to act on (each expert is its
    own): refused by name; one of the attention projections reads."""
    from benchmarks.bench_lora import write_random_adapter
    from sglang_like.lora.adapter import LoraAdapterError, read_adapter

    config = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32,
                         moe_layers=(True, False))
    mlp = write_random_adapter(tmp_path / "mlp", config, targets=("gate_proj",))
    with pytest.raises(LoraAdapterError, match="layer 0, a mixture of experts"):
        read_adapter("mlp", mlp, config)
    dense_mlp = write_random_adapter(tmp_path / "dense", config, targets=("gate_proj",),
                                     layers=range(1, 2))
    assert read_adapter("dense", dense_mlp, config).target_modules == ("gate_proj",)
    attn = write_random_adapter(tmp_path / "attn", config, targets=("q_proj", "v_proj"))
    assert set(read_adapter("attn", attn, config).target_modules) == {"q_proj", "v_proj"}


def test_deterministic_moe_is_batch_invariant(qwen3_moe: str) -> None:
    """--enable-deterministic-inference on an MoE model (x16 int4 experts, every batch on the
    native per-row path): each prompt alone, all together, and again after a radix hit give
    the same greedy tokens."""
    engine = _engine(qwen3_moe, quantization="int4", enable_deterministic_inference=True)
    try:
        engine.flush_cache()
        alone = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        engine.flush_cache()
        together = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        cached = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert alone == together == cached
    finally:
        engine.shutdown()


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_eagle3_head_on_an_moe_target(qwen3_moe: str, tmp_path: Any, quant: str) -> None:
    """An EAGLE-3 head (seeded random: its drafts are mostly rejected) on an MoE target: the
    head reads the target's captured layers, every verify runs through the sparse layers
    (int4: the native verify path and moe.c), and the greedy tokens are the plain run's."""
    from .spec_fakes import random_head

    plain = _engine(qwen3_moe, quantization=quant, disable_radix_cache=True)
    try:
        want = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
        config = plain.model_config
    finally:
        plain.shutdown()
    head = random_head(str(tmp_path / "head"), config.vocab_size, config.hidden_size,
                       config.num_hidden_layers)
    spec = _engine(qwen3_moe, quantization=quant, disable_radix_cache=True,
                   speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    try:
        outs = spec.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == want
        assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs) > 0
    finally:
        spec.shutdown()
