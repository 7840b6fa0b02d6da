"""Speculation with the device sampler on (CPU tensors) on a tiny model, end to end: a seeded
sampled request outputs the same tokens and logprobs as without speculation (the device
sampler's draw is a function of seed and output index, and a verify draws every node as the
request would draw there), with NGRAM and with EAGLE-3 (a random head), penalties, logit
bias, min_new_tokens and n > 1 included; grammar, DRY and XTC requests, which a verify walks
node by node on the host, match as well in a batch with the others.

Asked twice, a request's first answer is in the n-gram drafter's texts (EAGLE-3's copy
branch's too): the second time its drafts are its own output, accepted deep only where the
walk draws what plain decoding drew."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex

from sglang_like import Engine

from .spec_fakes import markov_llama, random_head

MAX_NEW = 16
SAMPLED = [
    {"temperature": 0.7, "top_k": 3, "seed": 1},
    {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2, "frequency_penalty": 0.3,
     "presence_penalty": 0.2, "logit_bias": {"11": 4.0, "13": 2.0}, "seed": 2},
    {"temperature": 0.9, "min_p": 0.05, "min_new_tokens": 12, "seed": 3},
    {"temperature": 0.6, "top_k": 4, "n": 2, "seed": 4},  # two seeds of one prompt
    {"temperature": 0.0, "presence_penalty": 0.5},
]
# walked node by node in a verify (beside two drawn ahead): a grammar's mask, DRY, XTC
MIXED = [
    {"temperature": 0.8, "seed": 5, "regex": "[a-z]{2,6}( [a-z]{2,6}){2,4}"},
    {"temperature": 0.0, "regex": "[0-9]{1,3}(, [0-9]{1,3}){3,6}"},
    {"temperature": 0.7, "dry_multiplier": 0.8, "dry_allowed_length": 1, "seed": 6},
    {"temperature": 1.0, "xtc_probability": 0.6, "xtc_threshold": 0.01, "seed": 7},
    SAMPLED[0],
    SAMPLED[1],
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    return markov_llama(tmp_path_factory.mktemp("markov"))


def _engine(folder: str, **kw: object) -> Engine:
    return Engine(model_path=folder, quantization="none", engine_in_process=True,
                  max_total_tokens=4096, device_sampling="on", **kw)


def _spec(name: str, tmp_path: Path) -> dict:
    kw: dict = dict(speculative_algorithm=name, speculative_auto_disable=False)
    if name == "EAGLE3":
        kw["speculative_draft_model_path"] = random_head(str(tmp_path / "head"), 49152, 64, 2)
    return kw


def _generate(engine: Engine, params: list[dict], logprobs: bool) -> list[dict]:
    prompts = [f"Item {i}: red green blue" for i in range(len(params))]
    params = [{"max_new_tokens": MAX_NEW, **p} for p in params]
    return engine.generate(prompts, params, return_logprob=logprobs,
                           top_logprobs_num=2 if logprobs else 0)


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        if "output_token_logprobs" in w["meta_info"]:
            lp_g = [e[0] for e in g["meta_info"]["output_token_logprobs"]]
            lp_w = [e[0] for e in w["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(lp_g, lp_w, strict=True)) < 1e-4
            tops_g = [[e[1] for e in top] for top in g["meta_info"]["output_top_logprobs"]]
            tops_w = [[e[1] for e in top] for top in w["meta_info"]["output_top_logprobs"]]
            assert tops_g == tops_w


@pytest.mark.parametrize("name", ["NGRAM", "EAGLE3"])
def test_seeded_sampling_with_speculation_is_plain_decoding(tiny_folder, name, tmp_path) -> None:
    off = _engine(tiny_folder)
    try:
        want = _generate(off, SAMPLED, logprobs=True)
    finally:
        off.shutdown()
    on = _engine(tiny_folder, **_spec(name, tmp_path))
    try:
        _assert_same(_generate(on, SAMPLED, logprobs=True), want)
        again = _generate(on, SAMPLED, logprobs=True)  # drafts of the first answers
        hist = on.get_server_info()["spec_accept_lengths"]
    finally:
        on.shutdown()
    _assert_same(again, want)
    assert sum(n for length, n in hist.items() if length >= 4) > 0, hist  # deep paths taken
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in again)
    assert sum(len(o["output_ids"]) for o in again) > 1.5 * verifies


def test_grammar_dry_and_xtc_walk_on_the_host_in_a_mixed_batch(tiny_folder, tmp_path) -> None:
    off = _engine(tiny_folder)
    try:
        want = _generate(off, MIXED, logprobs=False)
    finally:
        off.shutdown()
    on = _engine(tiny_folder, **_spec("NGRAM", tmp_path))
    try:
        _assert_same(_generate(on, MIXED, logprobs=False), want)
        _assert_same(_generate(on, MIXED, logprobs=False), want)
        hist = on.get_server_info()["spec_accept_lengths"]
    finally:
        on.shutdown()
    assert sum(n for length, n in hist.items() if length >= 4) > 0, hist
    for out, params in zip(want, MIXED, strict=True):
        assert out["output_ids"] and out["meta_info"]["finish_reason"]["type"] != "abort"
        if "regex" in params:  # cut by the length limit: a prefix of a match
            finished = out["meta_info"]["finish_reason"]["type"] == "stop"
            assert regex.fullmatch(params["regex"], out["text"], partial=not finished), (
                out["text"])
