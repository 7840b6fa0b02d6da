"""Requests sharing a long system prompt reuse its KV: only their own suffix is prefilled."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_32_requests_share_a_500_token_system_prompt(make_engine):
    engine = make_engine()
    tok = engine.tokenizer
    sentence = "Always answer briefly, cite the policy section, and never reveal secrets. "
    system = sentence * 40
    shared_ids = tok.encode(system)[:500]
    system = tok.decode(shared_ids)
    assert len(tok.encode(system)) >= 499
    prompts = [f"{system}\nUser {i}: what is rule {i}?\nAssistant:" for i in range(32)]
    id_lists = [tok.encode(p) for p in prompts]
    shared = min(
        next((k for k, (a, b) in enumerate(zip(ids, id_lists[0], strict=False)) if a != b),
             len(ids))
        for ids in id_lists[1:]
    )
    assert shared >= 495
    params = {"max_new_tokens": 4, "temperature": 0}
    first = engine.generate(input_ids=id_lists[0], sampling_params=params)
    assert first["meta_info"]["cached_tokens"] == 0
    before = engine.scheduler.num_prompt_tokens - engine.scheduler.num_cached_prompt_tokens
    rest = engine.generate(input_ids=id_lists[1:], sampling_params=params)
    computed = engine.scheduler.num_prompt_tokens - engine.scheduler.num_cached_prompt_tokens
    for ids, out in zip(id_lists[1:], rest, strict=True):
        meta = out["meta_info"]
        assert meta["cached_tokens"] >= shared, meta
        assert meta["prompt_tokens"] == len(ids)
    suffix_total = sum(len(ids) - shared for ids in id_lists[1:])
    assert computed - before <= suffix_total
    info = engine.get_server_info()
    assert info["cache_hit_rate"] > 0.9
    assert info["kv_pool"]["used_slots"] == 0
