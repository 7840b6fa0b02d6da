"""Parts of the dashboard on their own: the sampler's per-interval rates (a scripted stats
source), the latency windows, and the routes over an engine that has no cache to show."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sglang_like.server.dashboard.history import StatsHistory
from sglang_like.utils.stats_window import SlidingWindow, percentile


def _raw(t: float, prompt: int, cached: int, generated: int, evicted: int,
         accept: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "t": t, "kv_pool": {"total_slots": 100, "free_slots": 60, "used_slots": 10,
                            "evictable_slots": 30},
        "num_running_reqs": 1, "num_queued_reqs": 2, "num_prompt_tokens": prompt,
        "num_cached_prompt_tokens": cached, "num_generated_tokens": generated,
        "evicted_tokens": evicted, "num_tree_nodes": 5, "spec_accept_lengths": accept or {},
    }


class _ScriptedStats:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    def get_stats(self) -> dict[str, Any]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_history_turns_counters_into_rates():
    engine = _ScriptedStats([
        _raw(10.0, prompt=100, cached=0, generated=0, evicted=0),
        _raw(12.0, prompt=300, cached=150, generated=40, evicted=10,
             accept={"1": 2, "3": 2}),
        RuntimeError("engine gone"),
        _raw(13.0, prompt=300, cached=150, generated=40, evicted=10,
             accept={"1": 2, "3": 2}),
    ])
    history = StatsHistory(engine)
    first = history.sample()
    assert first["hit_rate"] is None and first["hit_rate_total"] == 0.0
    assert (first["free"], first["evictable"], first["in_use"], first["total"]) == (60, 30, 10, 100)
    second = history.sample()
    assert second["hit_rate"] == pytest.approx(150 / 200)  # this interval's prompts
    assert second["hit_rate_total"] == pytest.approx(150 / 300)
    assert second["tokens_per_s"] == pytest.approx(20.0)  # 40 tokens in 2 s
    assert second["evicted_per_s"] == pytest.approx(5.0)
    assert second["accept_length"] == pytest.approx((1 * 2 + 3 * 2) / 4)
    assert history.sample() is None and history.error == "RuntimeError: engine gone"
    third = history.sample()
    assert history.error is None
    assert third["hit_rate"] is None and third["tokens_per_s"] == 0.0  # nothing new
    assert third["accept_length"] is None
    assert [s["t"] for s in history.since(0.0)] == [first["t"], second["t"], third["t"]]
    assert history.since(second["t"]) == [third]


def test_sliding_window_percentiles_and_expiry():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    window = SlidingWindow(seconds=10.0)
    for i in range(100):
        window.add(float(i), t=100.0)
    window.add_many(1000.0, 3, t=105.0)
    summary = window.summary(now=106.0)
    assert summary["count"] == 103 and summary["max"] == 1000.0
    assert summary["p50"] == 51.0
    assert window.summary(now=112.0)["count"] == 3  # the first hundred aged out
    assert window.summary(now=200.0) is None


def test_routes_over_an_engine_without_a_cache(fake_server):
    """The fake engine has no radix tree: the page still loads, the data routes say why not."""
    url = fake_server.url
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(url + "/dashboard/static/dashboard.css").status_code == 200
    assert httpx.get(url + "/dashboard/static/nope.js").status_code == 404
    for method, path in (("GET", "/stats"), ("GET", "/cache_tree"),
                         ("GET", "/cache_tree/node/1"), ("POST", "/cache_match")):
        r = httpx.request(method, url + path, json={"text": "x"} if method == "POST" else None)
        assert r.status_code == 404, (path, r.text)
        assert "does not expose" in r.json()["error"]["message"]
