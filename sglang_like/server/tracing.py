"""OpenTelemetry traces of requests (--otlp-traces-endpoint): a root span per HTTP request and
its queue, prefill and decode spans, exported over OTLP/HTTP by the official SDK; and
`install`, which puts the request observer (server/request_log.py) in front of the app.

Spans are built once a request has ended, from its `RequestRecord` (server/request_log.py):
the engine's latencies (`queue_time`, `first_token_latency`, `e2e_latency`, seconds from the
request's arrival) placed on the wall clock. The SDK's batch processor sends them from a
thread of its own; a bounded queue in front of it drops (and counts) spans while the
collector is slow or down, so the request path never waits on the network.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, NamedTuple

from sglang_like.config import ServerArgs
from sglang_like.server import request_log
from sglang_like.server.request_log import EngineRequestRecord, RequestObserver, RequestRecord

logger = logging.getLogger(__name__)

_SERVICE_NAME = "sglang_like"
_TRACES_PATH = "/v1/traces"
# the SDK waits 5 s between exports by default; a trace should show up about when it ended
_DEFAULT_SCHEDULE_DELAY_MS = 1000
_DEFAULT_MAX_QUEUE_SIZE = 2048
_DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
_SHUTDOWN_WAIT_S = 3.0  # at exit, queued spans get this long: a dead collector must not hold it
_DROP_WARNING_INTERVAL_S = 60.0


def install(app: Any, server_args: ServerArgs) -> None:
    """Observe `app`'s requests when --log-requests or --otlp-traces-endpoint asks to; with
    neither, nothing is added to the request path."""
    if not (server_args.log_requests or server_args.otlp_traces_endpoint):
        return
    if server_args.log_requests_level not in request_log.LOG_REQUESTS_LEVELS:
        raise ValueError(f"log_requests_level must be one of {request_log.LOG_REQUESTS_LEVELS}")
    tracer = RequestTracer(server_args.otlp_traces_endpoint) if (
        server_args.otlp_traces_endpoint) else None
    if server_args.log_requests:
        # the flag asks for these lines whatever --log-level says
        request_log.logger.setLevel(logging.INFO)
    app.add_middleware(
        RequestObserver, tracer=tracer,
        log_level=server_args.log_requests_level if server_args.log_requests else None)


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: `http://host:4318` -> `http://host:4318/v1/traces`; a URL
    already ending in /v1/traces is kept; a bare `host:port` is taken as http."""
    url = endpoint.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"{endpoint!r} has a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{endpoint!r} is not an http(s) URL of an OTLP collector")
    path = parts.path.rstrip("/")
    if not path.endswith(_TRACES_PATH):
        path += _TRACES_PATH
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class Phase(NamedTuple):
    """One child span of a request: a name and its wall-clock bounds (ns)."""

    name: str
    start_ns: int
    end_ns: int


def phases(request: EngineRequestRecord) -> list[Phase]:
    """queue (arrival -> first scheduled), prefill (-> first token), decode (-> finish); the
    phases a request never reached are left out (aborted in the queue: queue only)."""
    arrival = request.arrival_ns
    scheduled = request.at_ns("queue_time")
    first_token = request.at_ns("first_token_latency")
    finish = request.at_ns("e2e_latency")
    if arrival is None or scheduled is None or finish is None:
        return []
    out = [Phase("queue", arrival, scheduled)]
    if first_token is not None:
        out += [Phase("prefill", scheduled, first_token), Phase("decode", first_token, finish)]
    elif finish > scheduled:  # scheduled, ended before its first token
        out.append(Phase("prefill", scheduled, finish))
    return out


class _SpanCounter:
    """Spans waiting for export and spans dropped; shared by the request path (admit) and the
    export thread (exported)."""

    def __init__(self, max_queued: int, collector: str) -> None:
        self.max_queued = max_queued
        self.collector = collector  # for the warning: scheme://host:port, no credentials
        self.num_queued = 0
        self.num_exported = 0
        self.num_dropped = 0
        self._lock = threading.Lock()
        self._warned_at: float | None = None

    def admit(self) -> bool:
        with self._lock:
            if self.num_queued >= self.max_queued:
                self.num_dropped += 1
                is_admitted = False
            else:
                self.num_queued += 1
                is_admitted = True
        if not is_admitted:
            self._warn()
        return is_admitted

    def exported(self, num_spans: int, is_ok: bool) -> None:
        with self._lock:
            self.num_queued -= num_spans
            if is_ok:
                self.num_exported += num_spans
            else:
                self.num_dropped += num_spans
        if not is_ok:
            self._warn()

    def _warn(self) -> None:
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < _DROP_WARNING_INTERVAL_S:
            return
        self._warned_at = now
        logger.warning("%d trace spans dropped so far: the OTLP collector at %s is slow or "
                       "down", self.num_dropped, self.collector)


class RequestTracer:
    """Turns finished `RequestRecord`s into spans and hands them to the export thread."""

    def __init__(self, endpoint: str) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise RuntimeError(
                "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install "
                "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http") from e
        self._trace = trace
        url = traces_url(endpoint)
        # the SDK's own variables (OTEL_BSP_*) size the queue and batches, as operators expect
        max_queued = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", _DEFAULT_MAX_QUEUE_SIZE)
        self.counter = _SpanCounter(max_queued, _without_credentials(url))
        exporter = _CountingExporter(OTLPSpanExporter(endpoint=url), self.counter)
        batcher = BatchSpanProcessor(
            exporter, max_queue_size=max_queued,
            schedule_delay_millis=_env_int("OTEL_BSP_SCHEDULE_DELAY", _DEFAULT_SCHEDULE_DELAY_MS),
            max_export_batch_size=min(max_queued, _env_int(
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _DEFAULT_MAX_EXPORT_BATCH_SIZE)))
        resource = Resource.create()  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": _SERVICE_NAME}))
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(_bounded_processor(batcher, self.counter))
        self._tracer = self._provider.get_tracer("sglang_like.server")
        self._propagator = TraceContextTextMapPropagator()
        # the exporter's retries of a down collector would each log a warning; the drops are
        # reported (once a minute) by _SpanCounter instead, and its errors still show
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.ERROR)
        atexit.register(self.shutdown)

    def export(self, record: RequestRecord, model: str | None) -> None:
        """The request's spans, queued for export (dropped if the queue is full)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self._propagator.extract(record.trace_headers) if record.trace_headers else None
        root = self._tracer.start_span(
            f"{record.method} {record.route}", context=parent, kind=SpanKind.SERVER,
            start_time=record.start_ns, attributes=_root_attributes(record, model))
        context = self._trace.set_span_in_context(root)
        for request in record.requests.values():
            for phase in phases(request):
                # inside the root span: the engine's clock and ours agree to microseconds, but
                # a wall-clock step (NTP) between them must not put a child outside its parent
                start = min(max(phase.start_ns, record.start_ns), record.end_ns)
                end = min(max(phase.end_ns, start), record.end_ns)
                child = self._tracer.start_span(
                    phase.name, context=context, start_time=start,
                    attributes=_phase_attributes(phase.name, request))
                child.end(end_time=end)
        failure = record.failure
        if failure is not None:
            root.set_status(Status(StatusCode.ERROR, failure))
        root.end(end_time=record.end_ns)

    def shutdown(self) -> None:
        """Send what is queued, waiting at most a few seconds."""
        done = threading.Thread(target=self._provider.shutdown, name="otlp-shutdown",
                                daemon=True)
        done.start()
        done.join(_SHUTDOWN_WAIT_S)


def _root_attributes(record: RequestRecord, model: str | None) -> dict[str, Any]:
    host, _, port = (record.client or "").rpartition(":")
    attributes: dict[str, Any] = {
        "http.request.method": record.method,
        "http.route": record.route,
        "sglang_like.rid": ",".join(record.rids),
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "sglang_like.cached_tokens": record.cached_tokens,
        "gen_ai.response.finish_reasons": record.finish_reasons,
    }
    if model:
        attributes["gen_ai.request.model"] = model
    if record.status is not None:
        attributes["http.response.status_code"] = record.status
    if host:
        attributes["client.address"] = host
        attributes["client.port"] = int(port)
    return attributes


def _phase_attributes(name: str, request: EngineRequestRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {"sglang_like.rid": request.rid}
    if name == "prefill":
        attributes["gen_ai.usage.input_tokens"] = int(request.meta.get("prompt_tokens") or 0)
        attributes["sglang_like.cached_tokens"] = int(request.meta.get("cached_tokens") or 0)
    elif name == "decode":
        attributes["gen_ai.usage.output_tokens"] = int(
            request.meta.get("completion_tokens") or 0)
    return attributes


def _bounded_processor(batcher: Any, counter: _SpanCounter) -> Any:
    """A span processor that admits a span to `batcher` only while fewer than the queue's
    size wait: the SDK's queue would drop the oldest without telling us."""
    from opentelemetry.sdk.trace import SpanProcessor

    class BoundedProcessor(SpanProcessor):
        def on_end(self, span: Any) -> None:
            if counter.admit():
                batcher.on_end(span)

        def shutdown(self) -> None:
            batcher.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return batcher.force_flush(timeout_millis)

    return BoundedProcessor()


class _CountingExporter:
    """The OTLP exporter, counting what it sent and what it failed to send (then dropped)."""

    def __init__(self, inner: Any, counter: _SpanCounter) -> None:
        self._inner = inner
        self._counter = counter

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._inner.export(spans)
        except Exception:  # noqa: BLE001 - counted as dropped; the thread goes on
            logger.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        self._counter.exported(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"${name} must be a whole number, not {value!r}") from None
    if number < 1:
        raise ValueError(f"${name} must be at least 1")
    return number


def _without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"  # IPv6
    if parts.port is not None:
        netloc += f":{parts.port}"
    return f"{parts.scheme}://{netloc}{parts.path}"
