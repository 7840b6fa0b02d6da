"""--otlp-traces-endpoint and --log-requests on a real server (default model), with the official
openai client: each request's trace reaches an OTLP/HTTP collector on loopback (decoded with
opentelemetry-proto's messages) as a root span with queue, prefill and decode children whose
links, times and token counts are right; a caller's `traceparent` continues its trace; the
request log line has the metadata (and, at the full level, the text) and never the key; a
collector that stops answering slows no request.

One server for the module (--api-key, --log-requests-level full). The tests run in file order;
the one that makes the collector hang is last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from router_cluster import this_folders_conftest

from sglang_like.server.request_log import (
    RequestObserver,
    RequestRecord,
    observe_call,
    observe_output,
)
from sglang_like.server.tracing import phases, traces_url

pytestmark = pytest.mark.slow

_conftest = this_folders_conftest()
API_KEY = "sk-trace-" + secrets.token_hex(8)
MESSAGES = [{"role": "user", "content": "Name a colour."}]
_WAIT_S = 60.0
# a span batch as small as one request's spans, sent at once: the tests wait for their trace,
# not for the SDK's timer; a queue of 4 requests' spans makes a hung collector drop quickly
_COLLECTOR_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
                  "OTEL_BSP_MAX_QUEUE_SIZE": "16"}


# ---- an OTLP/HTTP collector --------------------------------------------------------------------
@dataclass
class Collector:
    """Accepts POST /v1/traces (protobuf) and keeps the spans; `hang()` makes it stop answering."""

    spans: list[Any] = field(default_factory=list)
    posts: list[tuple[str, str]] = field(default_factory=list)  # (path, content type)
    changed: threading.Condition = field(default_factory=threading.Condition)
    is_hanging: bool = False
    released: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def receive(self, path: str, content_type: str, body: bytes) -> bytes | None:
        if self.is_hanging:
            self.released.wait()
            return None
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.changed:
            self.posts.append((path, content_type))
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self.changed.notify_all()
        return ExportTraceServiceResponse().SerializeToString()

    def wait_trace(self, is_root: Callable[[Any], bool], since: int = 0
                   ) -> tuple[Any, list[Any]]:
        """The first root span from `spans[since]` on that `is_root` accepts, once it and its
        three children arrived."""
        def found() -> tuple[Any, list[Any]] | None:
            for root in self.spans[since:]:
                if is_root(root):
                    children = [s for s in self.spans if s.trace_id == root.trace_id
                                and s.parent_span_id == root.span_id]
                    if len(children) >= 3:
                        return root, children
            return None

        with self.changed:
            assert self.changed.wait_for(found, _WAIT_S), "no complete trace arrived"
            return found()  # type: ignore[return-value]

    def num_spans(self) -> int:
        with self.changed:
            return len(self.spans)


def _handler(collector: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = collector.receive(self.path, self.headers.get("Content-Type", ""), body)
            if answer is None:
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    out = Collector()
    out.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(out))
    out.server.daemon_threads = True
    thread = threading.Thread(target=out.server.serve_forever, daemon=True)
    thread.start()
    yield out
    out.released.set()
    out.server.shutdown()
    out.server.server_close()


# ---- the server, its output kept ---------------------------------------------------------------
@dataclass
class LoggedServer:
    url: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_line(self, pattern: str) -> str:
        def found() -> str | None:
            return next((line for line in self.lines if re.search(pattern, line)), None)

        with self.changed:
            assert self.changed.wait_for(found, _WAIT_S), f"no line like {pattern!r}"
            return found()  # type: ignore[return-value]

    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)


@pytest.fixture(scope="module")
def server(collector: Collector) -> Iterator[LoggedServer]:
    port = _conftest.free_port()
    cmd = [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
           "--log-level", "warning", "--api-key", API_KEY, "--log-requests",
           "--log-requests-level", "full", "--otlp-traces-endpoint", collector.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **_COLLECTOR_ENV})
    out = LoggedServer(f"http://127.0.0.1:{port}", proc)
    threading.Thread(target=out.read, daemon=True).start()
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, f"server exited:\n{out.output()[-4000:]}"
        try:
            if httpx.get(out.url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.25)
    yield out
    _conftest.stop_real_server(_conftest.RealServer(out.url, proc))
    assert API_KEY not in out.output()


def _client(server: LoggedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120)


def _attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [v.string_value for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out


def _check_trace(root: Any, children: list[Any], usage: Any, finish_reason: str,
                 model: str) -> dict[str, Any]:
    """Links, times and counts of one request's trace; the root's attributes."""
    by_name = {s.name: s for s in children}
    assert sorted(by_name) == ["decode", "prefill", "queue"], [s.name for s in children]
    assert root.kind == root.SPAN_KIND_SERVER
    for child in children:
        assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    times = [root.start_time_unix_nano, queue.start_time_unix_nano, queue.end_time_unix_nano,
             prefill.start_time_unix_nano, prefill.end_time_unix_nano,
             decode.start_time_unix_nano, decode.end_time_unix_nano, root.end_time_unix_nano]
    assert times == sorted(times), times
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert prefill.end_time_unix_nano > prefill.start_time_unix_nano  # a forward ran
    # the spans are the engine's times, not the server's: the phases fit in a second here
    assert decode.end_time_unix_nano - queue.start_time_unix_nano < 60e9
    attrs = _attributes(root)
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [finish_reason]
    assert attrs["gen_ai.request.model"] == model
    assert attrs["http.route"] == "/v1/chat/completions"
    assert attrs["http.response.status_code"] == 200
    assert attrs["client.address"] == "127.0.0.1"
    assert root.status.code == root.status.STATUS_CODE_UNSET
    assert _attributes(prefill)["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert _attributes(decode)["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert _attributes(decode)["sglang_like.rid"] == attrs["sglang_like.rid"]
    return attrs


def _check_log_line(server: LoggedServer, rid: str, usage: Any, finish_reason: str,
                    model: str, text: str) -> None:
    line = server.wait_line(rf"request rid={re.escape(rid)} ")
    assert "INFO sglang_like.server.request_log" in line
    for expected in ("route=/v1/chat/completions", f"model={model}",
                     f"prompt_tokens={usage.prompt_tokens}",
                     f"completion_tokens={usage.completion_tokens}",
                     f"finish_reason={finish_reason}", "status=200", "client=127.0.0.1:"):
        assert f" {expected}" in line, (expected, line)
    assert re.search(r" latency=\d+\.\d{3}s ", line), line
    # the full level: the prompt as the model saw it (its template around the message) and
    # the output text, each one JSON string
    prompt, output = re.fullmatch(r".* prompt=(\".*\") output=(\".*\")\n", line).groups()
    assert MESSAGES[0]["content"] in json.loads(prompt)
    assert json.loads(output) == text


def test_chat_trace_and_log_line(server: LoggedServer, collector: Collector) -> None:
    before = collector.num_spans()
    # the key in both headers the server reads keys from: neither may reach the log
    response = _client(server).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3, temperature=0,
        extra_headers={"x-api-key": API_KEY})
    choice = response.choices[0]
    root, children = collector.wait_trace(
        lambda s: s.name == "POST /v1/chat/completions", since=before)
    assert root.parent_span_id == b""  # no caller's trace: a trace of its own
    attrs = _check_trace(root, children, response.usage, choice.finish_reason, response.model)
    assert {(path, ctype) for path, ctype in collector.posts} == {
        ("/v1/traces", "application/x-protobuf")}
    _check_log_line(server, attrs["sglang_like.rid"], response.usage, choice.finish_reason,
                    response.model, choice.message.content)
    assert API_KEY not in server.output()


def test_streamed_chat_trace_and_log_line(server: LoggedServer, collector: Collector) -> None:
    before = collector.num_spans()
    stream = _client(server).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    finish_reason = next(c.choices[0].finish_reason for c in chunks
                         if c.choices and c.choices[0].finish_reason)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    root, children = collector.wait_trace(
        lambda s: s.name == "POST /v1/chat/completions", since=before)
    attrs = _check_trace(root, children, usage, finish_reason, chunks[0].model)
    _check_log_line(server, attrs["sglang_like.rid"], usage, finish_reason, chunks[0].model,
                    text)


def test_traceparent_continues_the_callers_trace(server: LoggedServer,
                                                 collector: Collector) -> None:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    response = _client(server).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=2, temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
    root, children = collector.wait_trace(lambda s: s.trace_id.hex() == trace_id
                                          and s.name.startswith("POST "))
    assert root.parent_span_id.hex() == span_id
    _check_trace(root, children, response.usage, response.choices[0].finish_reason,
                 response.model)


def test_failed_request_is_an_error_span(server: LoggedServer, collector: Collector) -> None:
    """A request the engine refuses (a client rid already running is checked there): the
    trace's root span is an error with the answer's status, and the line says it."""
    trace_id = secrets.token_hex(16)
    body = {"text": ["Hi", "Ho"], "rid": ["a", "a"], "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert r.status_code == 400, r.text

    def root() -> Any:
        return next((s for s in collector.spans if s.trace_id.hex() == trace_id), None)

    with collector.changed:
        assert collector.changed.wait_for(root, _WAIT_S)
    span = root()
    assert span.name == "POST /generate"
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message == "HTTP 400"
    assert _attributes(span)["http.response.status_code"] == 400
    server.wait_line(r"request rid=a route=/generate .* status=400")


def test_hung_collector_slows_no_request(server: LoggedServer, collector: Collector) -> None:
    """Last: the collector takes requests and never answers (the exporter waits 10 s for
    each). Requests go on at their own pace, and spans past the queue are dropped, counted."""
    collector.is_hanging = True
    client = _client(server)
    for _ in range(8):  # 4 spans each: past the 16 the queue holds, the first batch stuck
        t0 = time.perf_counter()
        response = client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=2, temperature=0)
        assert response.choices[0].finish_reason in ("length", "stop")
        assert time.perf_counter() - t0 < 5.0
    line = server.wait_line(r"trace spans dropped so far")
    assert int(re.search(r"(\d+) trace spans dropped", line).group(1)) >= 1
    assert collector.url.removeprefix("http://") in line


# ---- the parts, without a server ---------------------------------------------------------------
@pytest.mark.parametrize("endpoint,url", [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://c.example/otlp/v1/traces", "https://c.example/otlp/v1/traces"),
    ("localhost:4318", "http://localhost:4318/v1/traces"),
])
def test_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["ftp://c:1", "http://", "http://c:port"])
def test_traces_url_refuses(endpoint: str) -> None:
    with pytest.raises(ValueError):
        traces_url(endpoint)


def test_log_levels_and_phases(caplog: pytest.LogCaptureFixture) -> None:
    """Through the middleware around a tiny app: the metadata line has no text, the full one
    adds it; n samples of one prompt count it once; no header reaches the record but the
    trace context; a request aborted in the queue has a queue phase only."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        observe_call("r1", {"prompt": "tell me"})
        for i, (latency, reason) in enumerate([(0.5, {"type": "length"}), (0.4, None)]):
            observe_output({"text": f"out{i}", "meta_info": {
                "id": f"r1-{i}", "prompt_tokens": 5, "completion_tokens": 2,
                "finish_reason": reason, "e2e_latency": latency, "queue_time": latency,
                "first_token_latency": None}})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    class Tracer:
        def export(self, record: RequestRecord, model: str | None) -> None:
            records.append(record)

    async def no_message() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def discard(message: Any) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/generate", "client": ("10.0.0.7", 5),
             "headers": [(b"authorization", b"Bearer secret-key"), (b"x-api-key", b"k2"),
                         (b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]}
    records: list[RequestRecord] = []
    caplog.set_level(logging.INFO, logger="sglang_like.server.request_log")
    for level in ("metadata", "full"):
        asyncio.run(RequestObserver(app, level, Tracer())(scope, no_message, discard))
    metadata, full = (r.getMessage() for r in caplog.records)
    assert re.fullmatch(
        r"request rid=r1-0,r1-1 route=/generate model=- prompt_tokens=5 completion_tokens=4 "
        r"finish_reason=length,unfinished latency=\d+\.\d{3}s client=10.0.0.7:5 status=200",
        metadata), metadata
    # the two runs' wall-clock latencies may differ by a millisecond: compare the rest
    def timeless(line: str) -> str:
        return re.sub(r"latency=\d+\.\d{3}s", "latency=", line)

    assert timeless(full) == timeless(metadata) + ' prompt="tell me" output=["out0", "out1"]'
    record = records[0]
    assert record.trace_headers == {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert record.failure == "request r1-1 did not finish"
    assert [p.name for p in phases(record.requests["r1-1"])] == ["queue"]
