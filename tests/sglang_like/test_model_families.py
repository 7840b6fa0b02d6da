"""Every model family from a tiny seeded random Hugging Face folder, against transformers.

Per family (and per RoPE scaling or feature a family adds): the engine on the folder equals
transformers in fp32 (prefill logits within 1e-4, greedy output for 3 prompts x 24 tokens),
and the default quantization (`auto`: int8 on CPU for a folder) keeps top-1 agreement with
fp32 of at least 95% over the prompts and their continuations. Sliding windows are smaller
than the sequences, so they are exercised, not only configured.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest
import torch

import sglang_like.engine_core.setup as setup_mod
from benchmarks.tiny_families import (  # noqa: F401  (test_family_gguf imports them here)
    FAMILIES,
    PROMPTS,
    SHARED,
    WINDOW,
    Family,
    build_folder,
    randomize,
)
from sglang_like import Engine
from sglang_like.model_loader import load_model

from .test_hf_archs import _hf_greedy, _hf_logits, _our_prefill_logits, tokenizer_json  # noqa: F401

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
LOGITS_ATOL = 1e-4
TOP1_MIN = 0.95
CONTEXT = 256


class Built(NamedTuple):
    family: Family
    path: str
    hf_model: Any
    engine: Engine


def _engine(path: str, **kwargs: Any) -> Engine:
    # the conftest may cache load_model for the default model; these folders go around it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setup_mod, "load_model", load_model)
        return Engine(model_path=path, max_total_tokens=4096, context_length=CONTEXT,
                      engine_in_process=True, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def built(request, tmp_path_factory, tokenizer_json: tuple[str, int]):  # noqa: F811
    family: Family = request.param
    folder = tmp_path_factory.mktemp(family.name)
    hf_model = build_folder(family, folder, tokenizer_json)
    engine = _engine(str(folder), quantization="none")
    yield Built(family, str(folder), hf_model, engine)
    engine.shutdown()


def _ids(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def test_prefill_logits_match_transformers(built: Built) -> None:
    for ids in _ids(built.engine):
        got, want = _our_prefill_logits(built.engine, ids), _hf_logits(built.hf_model, ids)
        assert got.shape == want.shape
        assert want.std().item() > 0.1  # far from flat: the comparison means something
        assert (got - want).abs().max().item() < LOGITS_ATOL


def test_greedy_matches_transformers(built: Built) -> None:
    id_lists = _ids(built.engine)
    outs = built.engine.generate(
        input_ids=id_lists,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    for ids, out in zip(id_lists, outs, strict=True):
        assert out["output_ids"] == _hf_greedy(built.hf_model, ids, NEW_TOKENS)


def test_window_and_features_are_exercised(built: Built) -> None:
    """The family's own settings reached the model, and the sequences outrun the window."""
    cfg, fam = built.engine.model_config, built.family
    layers = built.engine.runner.model.model.layers
    if "sliding_window" in fam.config:
        windows = [layer.description.sliding_window for layer in layers]
        assert WINDOW in windows
        assert min(len(ids) for ids in _ids(built.engine)) + NEW_TOKENS > 2 * WINDOW
    if fam.model_type in ("gemma2", "gemma3_text"):
        assert {layer.description.norm_layout for layer in layers} == {"sandwich"}
        assert cfg.attention_scale == pytest.approx(24 ** -0.5)
    if fam.model_type == "gemma3_text":
        assert [layer.description.rope for layer in layers] == ["local", "global"]
    if fam.model_type == "smollm3":
        assert [layer.description.rope for layer in layers] == ["global", "none"]
    if fam.model_type == "olmo2":
        assert layers[0].description.qk_norm == "full"
    if fam.model_type == "phi3":
        assert cfg.rotary_dim == 8
    if fam.model_type == "granite":
        assert (cfg.embedding_scale, cfg.residual_scale, cfg.logit_scale) == (3.0, 0.5, 0.4)


def test_default_quantization_tracks_fp32(built: Built) -> None:
    """`auto` (int8 linears on CPU for a folder): top-1 of every position of the prompts and
    their fp32 greedy continuations agrees with transformers' fp32 on >= 95%."""
    engine = _engine(built.path)
    try:
        assert engine.server_args.quantization != "none"
        agree = total = 0
        for ids in _ids(engine):
            seq = ids + _hf_greedy(built.hf_model, ids, NEW_TOKENS)
            got = _our_prefill_logits(engine, seq).argmax(-1)
            want = _hf_logits(built.hf_model, seq).argmax(-1)
            agree += int((got == want).sum())
            total += len(seq)
        print(f"{built.family.name}: top-1 agreement {agree}/{total}")
        assert agree / total >= TOP1_MIN
    finally:
        engine.shutdown()


WINDOWED = [f for f in FAMILIES if f.name in ("mistral-window", "gemma2", "gemma3")]


@pytest.mark.parametrize("built", WINDOWED, ids=[f.name for f in WINDOWED], indirect=True)
@pytest.mark.parametrize("speculative", [None, "NGRAM"])
def test_window_with_radix_hits_chunks_and_speculation(built: Built, speculative: str | None
                                                       ) -> None:
    """Sliding layers under the scheduler's other paths: prompts that share a prefix longer
    than the window (the second ones hit the radix cache), prefill in chunks smaller than the
    window, and n-gram speculation (whose verify attends through per-request masks): greedy
    output still equals transformers'."""
    engine = _engine(built.path, quantization="none", chunked_prefill_size=5,
                     speculative_algorithm=speculative)
    try:
        shared = engine.tokenizer.encode(PROMPTS[1])
        assert len(shared) > 2 * WINDOW
        id_lists = [shared + engine.tokenizer.encode(tail) for tail in (" # a", " # b", " # c")]
        engine.generate(input_ids=id_lists[0], sampling_params={"max_new_tokens": 1})
        outs = engine.generate(input_ids=id_lists, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        assert any(o["meta_info"]["cached_tokens"] >= len(shared) for o in outs)
        for ids, out in zip(id_lists, outs, strict=True):
            assert out["output_ids"] == _hf_greedy(built.hf_model, ids, NEW_TOKENS)
    finally:
        engine.shutdown()


TP_FAMILIES = [f for f in FAMILIES if f.name in ("gemma3", "phi3-longrope-partial")]


@pytest.mark.parametrize("built", TP_FAMILIES, ids=[f.name for f in TP_FAMILIES],
                         indirect=True)
def test_tensor_parallel_family_equals_transformers(built: Built) -> None:
    """Two ranks, each with its share of heads (Gemma 3's per-head q/k norms and local RoPE,
    Phi-3's split fused weights and partial rotary): greedy output still transformers'."""
    engine = _engine(built.path, quantization="none", tp_size=2)
    try:
        id_lists = _ids(engine)
        outs = engine.generate(input_ids=id_lists, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        for ids, out in zip(id_lists, outs, strict=True):
            assert out["output_ids"] == _hf_greedy(built.hf_model, ids, NEW_TOKENS)
    finally:
        engine.shutdown()


def test_olmo2_refuses_tensor_parallel_by_name(tmp_path, tokenizer_json) -> None:  # noqa: F811
    """OLMo 2's q/k norm spans every head: one rank cannot compute it alone."""
    olmo = next(f for f in FAMILIES if f.name == "olmo2")
    build_folder(olmo, tmp_path, tokenizer_json)
    with pytest.raises(Exception, match="OLMo 2"):
        _engine(str(tmp_path), quantization="none", tp_size=2)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path,
                                                                 tokenizer_json) -> None:  # noqa: F811
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (text_config, weights under
    language_model.*, a vision tower): the folder loads as its language model and equals
    transformers' multimodal model on text."""
    text, vocab_size = tokenizer_json
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    gemma3 = next(f for f in FAMILIES if f.name == "gemma3")
    text_cfg = SHARED | gemma3.config | {"vocab_size": vocab_size}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(7)
    hf_model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text_cfg, vision_config=vision, mm_tokens_per_image=4)).eval()
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    engine = _engine(str(tmp_path), quantization="none")
    try:
        assert engine.model_config.architecture == "gemma3_text"
        for ids in _ids(engine):
            want = _hf_logits(hf_model, ids)
            assert want.std().item() > 0.1
            assert (_our_prefill_logits(engine, ids) - want).abs().max().item() < LOGITS_ATOL
    finally:
        engine.shutdown()
