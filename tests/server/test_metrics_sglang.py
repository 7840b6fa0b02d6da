"""/metrics under SGLang's names too (`sglang:*`, label `model_name`), so dashboards built for
SGLang read ours: after real requests on a real server, each SGLang-named value moved as our
own metric did, and as the responses say."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def _scrape(server: Any) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_sglang_names_move_with_ours(real_server: Any) -> None:
    model = httpx.get(real_server.url + "/v1/models").json()["data"][0]["id"]
    before = _scrape(real_server)
    body = {"model": model, "prompt": "Counting: one, two,", "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    usages = [httpx.post(real_server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
              for _ in range(2)]
    with httpx.stream("POST", real_server.url + "/generate", timeout=60, json={
            "text": "The alphabet: a, b, c,", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                meta = json.loads(line[len("data: "):])["meta_info"]
    usages.append({"prompt_tokens": meta["prompt_tokens"],
                   "completion_tokens": meta["completion_tokens"]})
    after = _scrape(real_server)
    info = httpx.get(real_server.url + "/get_server_info").json()

    def moved(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    sg = {"model_name": model}
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 16
    assert moved("sglang:prompt_tokens_total", **sg) == moved("sglang_like_prompt_tokens_total")
    assert moved("sglang:prompt_tokens_total", **sg) == prompt
    assert moved("sglang:generation_tokens_total", **sg) == generated
    assert moved("sglang_like_generation_tokens_total") == generated
    assert moved("sglang:cached_tokens_total", **sg) == moved("sglang_like_cached_tokens_total")
    finished = _total(after, "sglang_like_requests_total") - _total(before,
                                                                     "sglang_like_requests_total")
    assert moved("sglang:num_requests_total", **sg) == finished == 3
    assert moved("sglang:num_aborted_requests_total", **sg) == 0
    for ours, theirs in [("time_to_first_token_seconds", "time_to_first_token_seconds"),
                         ("inter_token_latency_seconds", "inter_token_latency_seconds"),
                         ("e2e_request_latency_seconds", "e2e_request_latency_seconds"),
                         ("queue_time_seconds", "queue_time_seconds")]:
        for part in ("_count", "_sum"):
            assert moved(f"sglang:{theirs}{part}", **sg) == pytest.approx(
                moved(f"sglang_like_{ours}{part}")), theirs + part
        top = {"le": "+Inf", **sg}
        assert _value(after, f"sglang:{theirs}_bucket", **top) == _value(
            after, f"sglang:{theirs}_count", **sg)
    assert moved("sglang:time_to_first_token_seconds_count", **sg) == 1  # the streamed one
    assert moved("sglang:inter_token_latency_seconds_count", **sg) == 6 - 1
    assert moved("sglang:e2e_request_latency_seconds_count", **sg) == 3
    # gauges, as of this scrape
    for ours, theirs in [("num_running_reqs", "num_running_reqs"),
                         ("num_queued_reqs", "num_queue_reqs"),
                         ("cache_hit_rate", "cache_hit_rate"),
                         ("kv_pool_used_slots", "num_used_tokens")]:
        assert _value(after, f"sglang:{theirs}", **sg) == _value(after, f"sglang_like_{ours}")
    total = info["kv_pool"]["total_slots"]
    assert _value(after, "sglang:max_total_num_tokens", **sg) == total
    assert _value(after, "sglang:token_usage", **sg) == pytest.approx(
        _value(after, "sglang_like_kv_pool_used_slots") / total)
    assert 0 < _value(after, "sglang:cache_hit_rate", **sg) == pytest.approx(
        info["cache_hit_rate"])
    # tokens generated between the two scrapes, per second of the time between them
    assert _value(after, "sglang:gen_throughput", **sg) > 0
