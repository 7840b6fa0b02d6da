"""Multi-LoRA in the engine (issue #50), on the default model with hand-written PEFT files
(tests/sglang_like/test_lora_peft.py holds the comparisons with PEFT itself, and
test_lora_families.py the families whose checkpoints fuse or reorder rows).

What is asserted: adapters the runtime cannot serve are refused by name at load, nothing
changed; the native one-call decode step adds each linear's delta as the torch formula
does; a mixed batch equals each request alone; KV is never shared across adapters or loads;
`max_loras_per_batch` makes the extra adapters wait, not fail; unloading never fails a
request in flight; eviction, pins; speculation, grammars and n > 1 on an adapter."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import sglang_like.layers.native_decode as native_decode
from benchmarks.bench_lora import write_random_adapter as write_adapter
from sglang_like.lora import LoraAdapterError, LoraRegistry, parse_lora_paths, read_adapter

from .prompts import PROMPTS

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, make_engine) -> dict[str, str]:
    cfg = make_engine(max_total_tokens=1024, quantization="none").model_config
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": write_adapter(root / "a", cfg, rank=8, seed=1),
        "b": write_adapter(root / "b", cfg, rank=16, seed=2, targets=("q_proj", "v_proj")),
        "c": write_adapter(root / "c", cfg, rank=4, seed=3, targets=("o_proj", "down_proj")),
        # the last layer only: its delta reaches the residual without 29 layers after it
        "last": write_adapter(root / "last", cfg, rank=8, seed=4,
                              layers=range(cfg.num_hidden_layers - 1, cfg.num_hidden_layers),
                              b_std=0.2),
    }


@pytest.fixture(scope="module")
def engine(make_engine, adapters):
    # deterministic mode: every batch (prefill too) on the per-row native path, so a
    # request's output cannot depend on what runs beside it
    return make_engine(quantization="auto", max_total_tokens=4096,
                       enable_deterministic_inference=True,
                       lora_paths=[f"{k}={v}" for k, v in adapters.items() if k != "last"])


def test_lora_paths_forms() -> None:
    assert parse_lora_paths(["x=/p/x", "/p/y", '{"lora_name": "z", "lora_path": "/p/z", '
                                               '"pinned": true}']) == [
        ("x", "/p/x", False), ("/p/y", "/p/y", False), ("z", "/p/z", True)]
    with pytest.raises(ValueError, match="distinct"):
        parse_lora_paths(["x=/a", "x=/b"])
    with pytest.raises(ValueError, match="lora_name and lora_path"):
        parse_lora_paths(['{"lora_path": "/a"}'])


def test_settings_that_cannot_run_are_refused(make_engine) -> None:
    with pytest.raises(ValueError, match="max_loras_per_batch must be >= 1"):
        make_engine(enable_lora=True, max_loras_per_batch=0, max_total_tokens=1024)
    with pytest.raises(ValueError, match="lora_target_modules: unknown"):
        make_engine(enable_lora=True, lora_target_modules=("lm_head",), max_total_tokens=1024)
    plain = make_engine(max_total_tokens=1024)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate("Hi", GREEDY, lora_path="a")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.load_lora_adapter("a", "/nowhere")


def test_adapters_that_cannot_be_served_are_refused_by_name(tmp_path, engine) -> None:
    cfg = engine.model_config

    def refused(folder: Path, match: str, **kw: Any) -> None:
        with pytest.raises(LoraAdapterError, match=match):
            read_adapter("x", str(folder), cfg, **kw)

    refused(tmp_path / "missing", "not a folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no adapter_config.json")
    refused(Path(write_adapter(tmp_path / "dora", cfg, use_dora=True)), "DoRA")
    refused(Path(write_adapter(tmp_path / "head", cfg, targets=("q_proj",),
                               modules_to_save=["lm_head"])), "modules_to_save")
    folder = Path(write_adapter(tmp_path / "emb", cfg, targets=("q_proj",)))
    conf = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(
        conf | {"target_modules": ["q_proj", "embed_tokens"]}))
    refused(folder, "embed_tokens")
    refused(Path(write_adapter(tmp_path / "r32", cfg, rank=32, targets=("q_proj",))),
            "rank 32, above --max-lora-rank 16", max_rank=16)
    refused(Path(write_adapter(tmp_path / "o", cfg, targets=("o_proj",))),
            "targets o_proj, which --lora-target-modules", target_modules=("q_proj",))
    # an adapter made for another model: a wider hidden size
    other = cfg.replace(hidden_size=cfg.hidden_size * 2)
    refused(Path(write_adapter(tmp_path / "wide", other, targets=("q_proj",))),
            "do not fit the model")
    refused(Path(write_adapter(tmp_path / "deep", cfg.replace(num_hidden_layers=40),
                               targets=("q_proj",), layers=range(35, 36))),
            "past the model's 30 layers")
    # refused over the engine too, with nothing changed
    before = engine.list_lora_adapters()
    with pytest.raises(ValueError, match="DoRA"):
        engine.load_lora_adapter("dora", str(tmp_path / "dora"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("a", str(tmp_path / "dora"))
    assert engine.list_lora_adapters() == before


def test_fused_step_adds_each_linears_delta_as_the_torch_formula(make_engine, adapters) -> None:
    """The one-call decode step (decode_step.c) against the per-op path (layers.lora's torch
    formula over the same native matmuls) on an adapter of the last layer: the residual
    stream after it agrees to float32 rounding (a delta computed wrong would move it by the
    delta's size); base rows stay bit-identical."""
    eng = make_engine(quantization="auto", max_total_tokens=1024,
                      lora_paths=[f"last={adapters['last']}"])
    eng.generate(PROMPTS[0], {"max_new_tokens": 2})  # a decode step builds the native plan
    plan = eng.runner.model._native_plan
    if plan is None or plan.fused is None:
        pytest.skip("the one-call step does not run this machine's kernel choice")
    seen: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    original = native_decode.NativeDecodePlan.run

    def both(self, x, fb, pool, attn, aux):  # the per-op path first, on a copy
        fused, self.fused = self.fused, None
        try:
            per_op, _ = original(self, x.clone(), fb, pool, attn, aux)
        finally:
            self.fused = fused
        out = original(self, x, fb, pool, attn, aux)
        # each row's request (a prefill runs natively too: a prompt's rows, then the next's)
        owner = torch.arange(fb.batch_size).repeat_interleave(fb.extend_lens)
        seen.append((out[0], per_op, fb.lora is not None, owner))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_decode.NativeDecodePlan, "run", both)
        eng.generate(PROMPTS[:3], {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                     lora_path=["last", None, "last"])
    assert seen and all(with_lora for _, _, with_lora, _ in seen)
    for fused, per_op, _, owner in seen:
        assert torch.equal(fused[owner == 1], per_op[owner == 1])  # the base request's rows
        for row in (owner != 1).nonzero().flatten().tolist():
            rel = (fused[row] - per_op[row]).norm() / fused[row].norm()
            assert rel < 1e-5, rel
    # the adapter acts: the first token's distribution moves by far more than rounding (its
    # greedy tokens may not: on an AMD EPYC all 16 stayed the base's)
    one = {**GREEDY, "max_new_tokens": 1}
    with_it, base = (eng.generate(PROMPTS[0], one, lora_path=name, return_logprob=True,
                                  top_logprobs_num=5)["meta_info"]["output_top_logprobs"][0]
                     for name in ("last", None))
    moved = max(abs(a[0] - b[0]) for a, b in zip(with_it, base, strict=True))
    print(f"largest top-5 logprob move with the adapter: {moved:.4f}")
    assert moved > 1e-3, (with_it, base)


def test_mixed_batch_equals_each_request_alone(engine) -> None:
    prompts = PROMPTS[:8]
    names = [None, "a", "b", "c", "a", None, "c", "b"]
    alone = [engine.generate(p, GREEDY, lora_path=n)["output_ids"]
             for p, n in zip(prompts, names, strict=True)]
    engine.flush_cache()
    together = engine.generate(prompts, GREEDY, lora_path=names)
    assert [o["output_ids"] for o in together] == alone
    # each adapter changes the output of the same prompt
    outs = {n: engine.generate(prompts[0], GREEDY, lora_path=n)["output_ids"]
            for n in (None, "a", "b", "c")}
    assert len({tuple(v) for v in outs.values()}) == 4
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.generate(prompts[0], GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match="one entry per prompt"):
        engine.generate(prompts[:2], GREEDY, lora_path=["a"])


def test_kv_is_never_shared_across_adapters_or_loads(engine, adapters) -> None:
    engine.flush_cache()
    prompt = PROMPTS[3] * 3
    assert engine.generate(prompt, GREEDY)["meta_info"]["cached_tokens"] == 0
    first = engine.generate(prompt, GREEDY, lora_path="a")
    assert first["meta_info"]["cached_tokens"] == 0  # the base's KV is not the adapter's
    again = engine.generate(prompt, GREEDY, lora_path="a")
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == first["output_ids"]
    assert engine.generate(prompt, GREEDY, lora_path="b")["meta_info"]["cached_tokens"] == 0
    # the dashboard's view: each adapter's branch starts at the root under its namespace
    from radix_cache.namespace import token_namespace

    snap = engine.cache_tree(rows=True)
    names = snap["lora_namespaces"]
    first_tokens = [row[snap["fields"].index("token_ids")][0] for row in snap["rows"]
                    if row[snap["fields"].index("token_ids")]]
    labelled = {names.get(str(token_namespace(t))) for t in first_tokens if t < 0}
    assert {"a", "b"} <= labelled
    # the same name loaded again (other weights, here the same file) starts afresh
    engine.unload_lora_adapter("a")
    engine.load_lora_adapter("a", adapters["a"])
    reloaded = engine.generate(prompt, GREEDY, lora_path="a")
    assert reloaded["meta_info"]["cached_tokens"] == 0
    assert reloaded["output_ids"] == first["output_ids"]


def test_unload_never_fails_a_request_in_flight(engine, adapters) -> None:
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    want = engine.generate(PROMPTS[5], params, lora_path="c")["output_ids"]
    chunks = []
    stream = engine.generate(PROMPTS[5], params, lora_path="c", stream=True)
    for i, chunk in enumerate(stream):
        chunks.append(chunk)
        if i == 2:
            info = engine.unload_lora_adapter("c")
            assert info["in_flight"] == 1
            with pytest.raises(ValueError, match="'c' is not loaded"):
                engine.generate(PROMPTS[5], params, lora_path="c")
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert sum((c["output_ids"] for c in chunks), []) == want
    assert "c" not in {a["name"] for a in engine.list_lora_adapters()}
    with pytest.raises(ValueError, match="no LoRA adapter named 'c'"):
        engine.unload_lora_adapter("c")
    engine.load_lora_adapter("c", adapters["c"])  # as the other tests expect it


def test_extra_adapters_wait_their_turn(make_engine, adapters) -> None:
    """max_loras_per_batch=1: requests on three adapters and the base, sent at once, all
    finish with the output each has alone, and no step ever ran two adapters."""
    eng = make_engine(quantization="auto", max_total_tokens=4096, max_loras_per_batch=1,
                      enable_deterministic_inference=True,
                      lora_paths=[f"{k}={adapters[k]}" for k in ("a", "b", "c")])
    names = ["a", "b", "c", None, "a", "b"]
    alone = [eng.generate(PROMPTS[i], GREEDY, lora_path=n)["output_ids"]
             for i, n in enumerate(names)]
    eng.flush_cache()
    seen: set[int] = set()
    scheduler = eng.scheduler
    step = scheduler.step

    def watched() -> Any:
        out = step()
        running = {r.lora.uid for r in scheduler.running if r.lora is not None}
        seen.add(len(running))
        return out

    scheduler.step = watched
    try:
        results: list[Any] = [None] * len(names)

        def run(i: int) -> None:
            results[i] = eng.generate(PROMPTS[i], GREEDY, lora_path=names[i])["output_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(names))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        scheduler.step = step
    assert results == alone
    assert max(seen) == 1


def test_registry_pins_evicts_and_counts() -> None:
    class Fake:
        def __init__(self, name: str) -> None:
            self.name, self.path, self.rank, self.nbytes = name, "/x", 4, 0

        def info(self) -> dict[str, Any]:
            return {"name": self.name}

    reg = LoraRegistry(max_loaded=2)
    assert reg.install(Fake("p"), pinned=True) == []
    assert reg.install(Fake("q")) == []
    held = reg.acquire("q")
    with pytest.raises(ValueError, match="none can be evicted"):
        reg.install(Fake("r"))  # p pinned, q in use
    LoraRegistry.release(held)
    assert reg.install(Fake("r")) == ["q"]
    assert reg.names() == ["p", "r"]
    with pytest.raises(ValueError, match="already loaded"):
        reg.install(Fake("r"))
    first = reg.get("r").uid
    reg.unload("r")
    reg.install(Fake("r"))
    assert reg.get("r").uid != first


def test_speculation_grammar_and_samples_on_an_adapter(make_engine, adapters) -> None:
    eng = make_engine(quantization="auto", max_total_tokens=4096,
                      speculative_algorithm="NGRAM", enable_deterministic_inference=True,
                      lora_paths=[f"a={adapters['a']}"])
    plain = make_engine(quantization="auto", max_total_tokens=4096,
                        enable_deterministic_inference=True,
                        lora_paths=[f"a={adapters['a']}"])
    eagle = make_engine(quantization="auto", max_total_tokens=4096,
                        speculative_algorithm="EAGLE3", enable_deterministic_inference=True,
                        lora_paths=[f"a={adapters['a']}"])
    prompt = "Repeat after me: one two three four five one two three four five one two"
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    want = plain.generate(prompt, params, lora_path="a")["output_ids"]
    # the drafters know nothing of adapters (EAGLE's head drafts as for the base); the
    # verify runs on the adapter, so greedy output stays the adapter's own
    assert eng.generate(prompt, params, lora_path="a")["output_ids"] == want
    assert eagle.generate(prompt, params, lora_path="a")["output_ids"] == want
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = plain.generate("A person as JSON:", {"max_new_tokens": 64, "temperature": 0.7,
                                               "json_schema": json.dumps(schema), "n": 2,
                                               "seed": 3}, lora_path="a")
    assert len(out) == 2
    for o in out:
        jsonschema.validate(json.loads(o["text"]), schema)
    entry = plain.scheduler.loras.get("a")
    assert entry is not None and entry.in_flight == 0  # every request let go of it


def test_stacked_form_equals_grouped_form(engine) -> None:
    """What CUDA runs (the batch's adapters stacked and zero-padded, one slot per row, as
    triton_ops.lora_delta_ takes them; its kernels equal reference.lora_delta_ under the
    interpreter in tests/kernels) adds the same deltas as the CPU's matmuls per group."""
    from sglang_like.layers.lora import LoraBatch, apply_lora
    from sglang_like_kernels import reference

    loras = engine.scheduler.loras
    weights = [None, loras.get("a").adapter.weights, loras.get("b").adapter.weights, None,
               loras.get("a").adapter.weights]
    lens = [2, 3, 1, 2, 1]
    batch = LoraBatch.build(weights, lens)
    gen = torch.Generator().manual_seed(0)
    for key in ("model.layers.0.self_attn.qkv_proj", "model.layers.5.mlp.gate_up_proj",
                "model.layers.7.mlp.down_proj"):
        w = weights[1][key]
        x = torch.randn(sum(lens), w.a.shape[1], generator=gen)
        y = torch.randn(sum(lens), w.b.shape[0], generator=gen)
        grouped = apply_lora(y, x, key, batch)
        stacked = y.clone()
        reference.lora_delta_(stacked, x, *batch.stacked(key))
        torch.testing.assert_close(stacked, grouped, rtol=1e-5, atol=1e-5)
        assert torch.equal(grouped[:2], y[:2]) and torch.equal(grouped[6:8], y[6:8])
    # b targets q and v only: no stack for the MLP beyond a's rows
    slots, a, b = batch.stacked("model.layers.5.mlp.gate_up_proj")
    assert a.shape[0] == 1 and slots.tolist() == [-1, -1, 0, 0, 0, -1, -1, -1, 0]
