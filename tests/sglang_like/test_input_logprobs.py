"""Prompt (input) logprobs stay exact with the radix cache warm (SGLang once truncated them for
cached prefixes): a prompt whose prefix is in the tree still gets one entry per prompt token
from logprob_start_len on, equal to a cold run. The scheduler never matches past
logprob_start_len - 1 (that row's logits predict the first asked-for token), so the cache only
serves tokens whose logprobs nobody asked for."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SHARED = " ".join(f"Item {i} costs {3 * i + 1} dollars." for i in range(10))
PROMPT = SHARED + " The cheapest item is"
OTHER = SHARED + " Which item costs the most? It is"
# fp32 ("none"): a warm run equals a cold one to 1e-4. The default int4 path runs bf16
# activations through kernels chosen by row count (and attention by path), so a cache hit (a
# shorter extend) can flip a bf16 rounding that 30 layers carry to the logprobs: the entries
# are all there and the same tokens, the values within that rounding. Measured over 4 prompts
# sharing this prefix x 3 hit lengths (1104 top-2 entries): 99% of them equal to the cold
# run's, the largest difference 2.8e-2 before the AMX kernels and the fused SDPA path came in
# and 2.8e-2 / 3.4e-2 (AMX on / off) after; OTHER after PROMPT, 5.0e-2, where the hit and the
# cold run each stand within 0.04 of fp32 (int4's own distance). The bound is that noise
# with a 2x margin, test_invariance's TIE_NATS. (PROMPT alone had measured 5.4e-3, the old
# bound's basis.)
TOL = {"none": 1e-4, "auto": 0.1}


@pytest.fixture(scope="module", params=[("none", None), ("none", 16), ("auto", None)],
                ids=["fp32", "fp32-chunked-16", "int4"])
def case(make_engine: Any, request: Any) -> tuple[Any, float]:
    """(engine, tolerance of a cache hit against a cold run)."""
    quantization, chunk = request.param
    engine = make_engine(max_total_tokens=8192, chunked_prefill_size=chunk,
                         quantization=quantization)
    return engine, TOL[quantization]


def _score(engine: Any, text: str, start: int, max_new_tokens: int = 0) -> dict[str, Any]:
    out = engine.generate(text, {"max_new_tokens": max_new_tokens, "temperature": 0,
                                 "ignore_eos": True},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=2)
    return out["meta_info"]


def _values(entries: list[list[Any]]) -> list[float | None]:
    return [e[0] for e in entries]


def _assert_same(got: dict[str, Any], cold: dict[str, Any], start: int, tol: float) -> None:
    """`got` (asked from `start`) has every entry of the cold run (asked from 0) from `start`."""
    entries, ref = got["input_token_logprobs"], cold["input_token_logprobs"][start:]
    assert len(entries) == len(ref) == got["prompt_tokens"] - start
    assert [e[1] for e in entries] == [e[1] for e in ref]
    if start == 0:
        assert entries[0][0] is None and got["input_top_logprobs"][0] is None
        entries, ref = entries[1:], ref[1:]
    assert _values(entries) == pytest.approx(_values(ref), abs=tol)
    tops = got["input_top_logprobs"][-len(ref):] if ref else []
    ref_tops = cold["input_top_logprobs"][-len(ref):] if ref else []
    for top, ref_top in zip(tops, ref_tops, strict=True):
        assert [t[1] for t in top] == [t[1] for t in ref_top]
        assert [t[0] for t in top] == pytest.approx([t[0] for t in ref_top], abs=tol)


def _cold(engine: Any, text: str) -> dict[str, Any]:
    assert _flush(engine)
    return _score(engine, text, 0)


def _flush(engine: Any) -> bool:
    deadline = time.monotonic() + 20
    while not engine.flush_cache():  # refused while requests are still finishing
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return True


def test_same_prompt_twice(case: tuple[Any, float]) -> None:
    engine, tol = case
    cold = _cold(engine, PROMPT)
    n = cold["prompt_tokens"]
    assert cold["cached_tokens"] == 0 and len(cold["input_token_logprobs"]) == n
    again = _score(engine, PROMPT, 0)  # the whole prompt is in the tree now
    _assert_same(again, cold, 0, 1e-6)  # the same forward: the same numbers
    for start in (1, n // 2, n - 1):
        hit = _score(engine, PROMPT, start)
        assert hit["cached_tokens"] == start - 1  # the cache serves all it may
        _assert_same(hit, cold, start, tol)


def test_prompt_sharing_a_prefix_with_an_earlier_one(case: tuple[Any, float]) -> None:
    engine, tol = case
    cold = _cold(engine, OTHER)
    assert _flush(engine)
    engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})  # caches SHARED + ...
    num_shared = len(engine.tokenizer.encode(SHARED))
    full = _score(engine, OTHER, 0)
    _assert_same(full, cold, 0, 1e-6)  # logprobs from 0: no prefix reused
    for start in (num_shared // 2, num_shared + 2):
        hit = _score(engine, OTHER, start)
        assert 0 < hit["cached_tokens"] <= start - 1
        _assert_same(hit, cold, start, tol)


def test_generation_after_a_cache_hit_keeps_both_parts(case: tuple[Any, float]) -> None:
    engine, tol = case
    cold = _cold(engine, PROMPT)
    start = cold["prompt_tokens"] // 2
    out = _score(engine, PROMPT, start, max_new_tokens=4)
    assert out["cached_tokens"] == start - 1 and out["completion_tokens"] == 4
    _assert_same(out, cold, start, tol)
    assert len(out["output_token_logprobs"]) == 4
