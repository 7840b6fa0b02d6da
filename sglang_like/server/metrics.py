"""Prometheus metrics of one server app, in its own CollectorRegistry (several apps may coexist):
ours (`sglang_like_*`) and the same measurements under SGLang's names (`sglang:*`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

from sglang_like.server.model_name import model_name_from_path
from sglang_like.utils.stats_window import SlidingWindow

_PREFIX = "sglang_like_"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class ServerMetrics:
    """Counters and histograms fed per request, gauges refreshed from the engine at scrape time.

    `model_name` is SGLang's `model_name` label; None: the served name the engine reports."""

    def __init__(self, model_name: str | None = None) -> None:
        self.model_name = model_name
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
        self.kv_pool_total_slots = Gauge(
            _PREFIX + "kv_pool_total_slots", "KV slots in the pool.", registry=r
        )
        self.gen_throughput = Gauge(
            _PREFIX + "gen_throughput", "Tokens generated per second between the last two "
            "scrapes of /metrics.", registry=r,
        )
        self._last_generated: tuple[float, float] | None = None  # (time, tokens) last scrape
        self._reported_name = ""  # the engine's served name, when model_name is None
        r.register(_SGLangNames(self))
        # inter-token latency of the last minute's streams, for the dashboard's percentiles
        self.itl_window = SlidingWindow(60.0)

    def observe_itl(self, per_token: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.inter_token_latency.observe(per_token)
        self.itl_window.add_many(per_token, num_tokens)

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
        self.kv_pool_total_slots.set(total)
        self.cache_hit_rate.set(_nonneg(server_info.get("cache_hit_rate")))
        self._refresh_throughput(_nonneg(server_info.get("num_generated_tokens")))
        if self.model_name is None:
            self._reported_name = _served_name(server_info)

    def _refresh_throughput(self, num_generated: float) -> None:
        now = time.monotonic()
        if self._last_generated is not None:
            then, before = self._last_generated
            if now > then and num_generated >= before:
                self.gen_throughput.set((num_generated - before) / (now - then))
        self._last_generated = (now, num_generated)

    @property
    def label_model_name(self) -> str:
        return self.model_name or self._reported_name or "default"

    def render(self) -> bytes:
        return generate_latest(self.registry)


# SGLang's name (its Grafana dashboards and alerts read these) for each of our metrics that
# measures the same thing, by ServerMetrics attribute; each carries SGLang's `model_name` label.
# Counters get `_total` on the sample as prometheus_client writes ours. Buckets are ours.
_SGLANG_NAMES = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "cached_tokens": "cached_tokens",
    "time_to_first_token": "time_to_first_token_seconds",
    "inter_token_latency": "inter_token_latency_seconds",
    "e2e_latency": "e2e_request_latency_seconds",
    "queue_time": "queue_time_seconds",
    "num_running_reqs": "num_running_reqs",
    "num_queued_reqs": "num_queue_reqs",
    "cache_hit_rate": "cache_hit_rate",
    "kv_pool_used_slots": "num_used_tokens",
    "kv_pool_total_slots": "max_total_num_tokens",
    "gen_throughput": "gen_throughput",
}


class _SGLangNames:
    """A collector that yields, at each scrape, our metrics under SGLang's names: the same
    samples (so the two can never disagree), plus what SGLang derives from them."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; the names are fixed above

    def collect(self) -> Iterator[Metric]:
        m, model = self._metrics, {"model_name": self._metrics.label_model_name}
        for attr, theirs in _SGLANG_NAMES.items():
            for family in getattr(m, attr).collect():
                yield _renamed(family, "sglang:" + theirs, model)
        yield _gauge("sglang:token_usage", "Fraction of KV slots held by live requests "
                     "(cached, evictable ones not counted).", model,
                     _ratio(m.kv_pool_used_slots, m.kv_pool_total_slots))
        by_reason = {s.labels.get("finish_reason"): s.value
                     for f in m.requests.collect() for s in f.samples
                     if s.name.endswith("_total")}
        yield _counter("sglang:num_requests_total", "Finished requests.", model,
                       sum(by_reason.values()))
        yield _counter("sglang:num_aborted_requests_total", "Requests that ended in an abort.",
                       model, by_reason.get("abort", 0.0))


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    out = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        suffix = sample.name[len(family.name):]
        if suffix != "_created":
            out.add_sample(name + suffix, {**sample.labels, **labels}, sample.value)
    return out


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> Metric:
    out = Metric(name, doc, "gauge")
    out.add_sample(name, labels, value)
    return out


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> Metric:
    out = Metric(name.removesuffix("_total"), doc, "counter")
    out.add_sample(name, labels, value)
    return out


def _ratio(num: Gauge, den: Gauge) -> float:
    total = den._value.get()  # noqa: SLF001 - a gauge's value; prometheus_client has no getter
    return num._value.get() / total if total else 0.0  # noqa: SLF001


def _served_name(server_info: dict[str, Any]) -> str:
    """The served model name from the engine's info, as ServerState derives it."""
    path = server_info.get("model_path") or ""
    fallback = model_name_from_path(path) if path else ""
    return str(server_info.get("served_model_name") or fallback)


def _nonneg(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
