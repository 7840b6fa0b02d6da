"""Prometheus metrics of one server app, in its own CollectorRegistry (several apps may coexist)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_PREFIX = "sglang_like_"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class ServerMetrics:
    """Counters and histograms fed per request, gauges refreshed from the engine at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token = Histogram(
            _PREFIX + "time_to_first_token_seconds", "Time to first token (streamed requests).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            _PREFIX + "inter_token_latency_seconds", "Time between streamed chunks, per token.",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e_latency = Histogram(
            _PREFIX + "e2e_request_latency_seconds", "End-to-end latency of finished requests.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            _PREFIX + "queue_time_seconds", "Time a request waited before its first prefill.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.spec_accept_length = Histogram(
            _PREFIX + "spec_accept_length", "Tokens per verify pass of finished speculative "
            "requests (completion tokens / spec_verify_ct).",
            buckets=_ACCEPT_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            _PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            _PREFIX + "generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            _PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.requests = Counter(
            _PREFIX + "requests", "Finished requests by finish reason.", ["finish_reason"],
            registry=r,
        )
        self.rejected_requests = Counter(
            _PREFIX + "rejected_requests", "Requests refused at the edge, by HTTP status.",
            ["status"], registry=r,
        )
        self.num_running_reqs = Gauge(
            _PREFIX + "num_running_reqs", "Requests in the running batch.", registry=r
        )
        self.num_queued_reqs = Gauge(
            _PREFIX + "num_queued_reqs", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_pool_usage = Gauge(
            _PREFIX + "kv_pool_usage", "Fraction of KV slots not free (used or cached).", registry=r
        )
        self.kv_pool_used_slots = Gauge(
            _PREFIX + "kv_pool_used_slots", "KV slots held by live requests.", registry=r
        )
        self.cache_hit_rate = Gauge(
            _PREFIX + "cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
            registry=r,
        )

    # ---- per request --------------------------------------------------------------------
    def observe_finished(self, meta_info: dict[str, Any]) -> None:
        """Count one finished (or aborted) request from its final meta_info."""
        self.prompt_tokens.inc(_nonneg(meta_info.get("prompt_tokens")))
        self.generation_tokens.inc(_nonneg(meta_info.get("completion_tokens")))
        self.cached_tokens.inc(_nonneg(meta_info.get("cached_tokens")))
        reason = meta_info.get("finish_reason")
        kind = reason.get("type", "unknown") if isinstance(reason, dict) else "unknown"
        self.requests.labels(finish_reason=str(kind)).inc()
        verifies = meta_info.get("spec_verify_ct")
        tokens = meta_info.get("completion_tokens")
        if isinstance(verifies, int) and verifies > 0 and isinstance(tokens, int):
            self.spec_accept_length.observe(tokens / verifies)
        e2e = meta_info.get("e2e_latency")
        if isinstance(e2e, (int, float)) and e2e >= 0:
            self.e2e_latency.observe(e2e)
        queue_time = meta_info.get("queue_time")
        if isinstance(queue_time, (int, float)) and queue_time >= 0:
            self.queue_time.observe(queue_time)

    def observe_rejected(self, status_code: int) -> None:
        self.rejected_requests.labels(status=str(status_code)).inc()

    # ---- at scrape time -----------------------------------------------------------------
    def refresh_gauges(self, server_info: dict[str, Any]) -> None:
        self.num_running_reqs.set(_nonneg(server_info.get("num_running_reqs")))
        self.num_queued_reqs.set(_nonneg(server_info.get("num_queued_reqs")))
        pool = server_info.get("kv_pool") or {}
        total = _nonneg(pool.get("total_slots"))
        free = _nonneg(pool.get("free_slots"))
        self.kv_pool_usage.set((total - free) / total if total else 0.0)
        self.kv_pool_used_slots.set(_nonneg(pool.get("used_slots")))
        self.cache_hit_rate.set(_nonneg(server_info.get("cache_hit_rate")))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _nonneg(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
