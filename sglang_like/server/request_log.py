"""One HTTP generate request, observed as it runs and reported once at its end: the request
log line (--log-requests) and its trace (--otlp-traces-endpoint, server/tracing.py).

The middleware opens a `RequestRecord` in a context variable; the runner (server/runner.py)
adds what it submits (`observe_call`) and every output it relays (`observe_output`), so the
routes of every API (OpenAI, native, Anthropic, Ollama) are observed through that one door.
Headers are never read into a record but `traceparent` / `tracestate`: no key can be logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang_like.engine_core.loop import is_derived_rid

logger = logging.getLogger(__name__)

LOG_REQUESTS_LEVELS = ("metadata", "full")

_CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "sglang_like_request_record", default=None)
# load balancers probe these every few seconds: their lines and traces would bury the requests'
_UNOBSERVED_PREFIXES = ("/health",)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_PLAIN_VALUE = re.compile(r"[\w.:/@+\-,]*")


@dataclass
class EngineRequestRecord:
    """One engine request (one prompt's sample) of an HTTP request, from its outputs."""

    rid: str
    prompt: Any  # the object it was submitted with: samples of one prompt share it
    meta: dict[str, Any] = field(default_factory=dict)  # the latest meta_info (counts cumulative)
    arrival_ns: int | None = None  # wall clock, estimated in `observe`
    text_parts: list[str] = field(default_factory=list)  # kept for the full log level only

    def observe(self, output: dict[str, Any], now_ns: int, keep_text: bool) -> None:
        self.meta = output.get("meta_info") or {}
        e2e = self.meta.get("e2e_latency")
        if isinstance(e2e, (int, float)) and e2e >= 0:
            # The engine times a request from its arrival (perf_counter, not the wall clock);
            # an output reaches us at or after it was built, so the earliest estimate is best.
            arrival_ns = now_ns - int(e2e * 1e9)
            if self.arrival_ns is None or arrival_ns < self.arrival_ns:
                self.arrival_ns = arrival_ns
        if keep_text and output.get("text"):
            self.text_parts.append(output["text"])

    @property
    def finish_reason(self) -> str | None:
        reason = self.meta.get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason

    @property
    def abort_message(self) -> str | None:
        reason = self.meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return str(reason.get("message") or "aborted")
        return None

    def at_ns(self, key: str) -> int | None:
        """The wall-clock time `arrival + meta[key]` (a latency in seconds), if both are known."""
        value = self.meta.get(key)
        if self.arrival_ns is None or not isinstance(value, (int, float)):
            return None
        return self.arrival_ns + int(value * 1e9)


@dataclass
class RequestRecord:
    """What one HTTP request did: where it came from, what it submitted, how it ended."""

    method: str
    route: str
    client: str | None
    start_ns: int
    trace_headers: dict[str, str]
    keep_text: bool
    submitted: dict[str, Any] = field(default_factory=dict)  # rid -> prompt object
    requests: dict[str, EngineRequestRecord] = field(default_factory=dict)
    lora: str | None = None
    status: int | None = None
    error: str | None = None  # the exception that ended it, if one did
    end_ns: int = 0

    @classmethod
    def start(cls, scope: Scope, keep_text: bool) -> RequestRecord:
        client = scope.get("client")
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope.get("headers", ()) if name in _TRACE_HEADERS}
        return cls(scope.get("method", ""), scope.get("path", ""),
                   f"{client[0]}:{client[1]}" if client else None, time.time_ns(), headers,
                   keep_text)

    @property
    def rids(self) -> list[str]:
        return list(self.requests) or list(self.submitted)

    @property
    def latency_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def prompt_tokens(self) -> int:
        """Counted once per prompt however many samples it has, as a response's usage is."""
        per_prompt = {id(r.prompt) if r.prompt is not None else r.rid:
                      int(r.meta.get("prompt_tokens") or 0) for r in self.requests.values()}
        return sum(per_prompt.values())

    @property
    def completion_tokens(self) -> int:
        return sum(int(r.meta.get("completion_tokens") or 0) for r in self.requests.values())

    @property
    def cached_tokens(self) -> int:
        per_prompt = {id(r.prompt) if r.prompt is not None else r.rid:
                      int(r.meta.get("cached_tokens") or 0) for r in self.requests.values()}
        return sum(per_prompt.values())

    @property
    def finish_reasons(self) -> list[str]:
        return [r.finish_reason or "unfinished" for r in self.requests.values()]

    @property
    def failure(self) -> str | None:
        """Why the request failed (an error status, an exception, an abort, an engine request
        left unfinished), or None."""
        if self.error is not None:
            return self.error
        if self.status is not None and self.status >= 400:
            return f"HTTP {self.status}"
        for r in self.requests.values():
            if r.finish_reason is None:
                return f"request {r.rid} did not finish"
            if r.abort_message is not None:
                return r.abort_message
        return None

    def prompt_of(self, rid: str) -> Any:
        if rid in self.submitted:
            return self.submitted[rid]
        for parent, prompt in self.submitted.items():
            if is_derived_rid(rid, parent):
                return prompt
        return None


def observe_call(rid: str | list[str], call: dict[str, Any]) -> None:
    """The runner submits an engine call (`rid`: its rid, or one per prompt of a batch) for
    the HTTP request in progress; nothing when none is observed."""
    record = _CURRENT.get()
    if record is None:
        return
    prompt = call.get("prompt") if call.get("prompt") is not None else call.get("input_ids")
    if isinstance(rid, list):
        prompts = prompt if isinstance(prompt, list) and len(prompt) == len(rid) else None
        for k, one in enumerate(rid):
            record.submitted[one] = prompts[k] if prompts is not None else None
    else:
        record.submitted[rid] = prompt
    lora = call.get("lora_path")
    if isinstance(lora, list):
        lora = next((name for name in lora if name), None)
    record.lora = record.lora or lora


def observe_output(output: dict[str, Any]) -> None:
    """The runner relays an engine output (a stream's chunk or a whole result)."""
    record = _CURRENT.get()
    if record is None:
        return
    rid = (output.get("meta_info") or {}).get("id")
    if not isinstance(rid, str):
        return
    request = record.requests.get(rid)
    if request is None:
        request = record.requests[rid] = EngineRequestRecord(rid, record.prompt_of(rid))
    request.observe(output, time.time_ns(), record.keep_text)


class RequestObserver:
    """ASGI middleware: a `RequestRecord` for each HTTP request; once the answer is sent, the
    requests that reached the engine get their log line and their trace."""

    def __init__(self, app: ASGIApp, log_level: str | None, tracer: Any = None) -> None:
        self.app = app
        self.log_level = log_level  # None: no log lines
        self.tracer = tracer  # a tracing.RequestTracer, or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith(_UNOBSERVED_PREFIXES):
            await self.app(scope, receive, send)
            return
        record = RequestRecord.start(scope, keep_text=self.log_level == "full")
        token = _CURRENT.set(record)

        async def send_observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        except BaseException as exc:
            record.error = type(exc).__name__
            if record.status is None:  # the outer error middleware answers 500; 499: gone
                record.status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            raise
        finally:
            _CURRENT.reset(token)
            record.end_ns = time.time_ns()
            if record.submitted or record.requests:
                self._report(scope, record)

    def _report(self, scope: Scope, record: RequestRecord) -> None:
        try:
            app = scope.get("app")
            state = getattr(app.state, "server", None) if app is not None else None
            model = record.lora or getattr(state, "served_model_name", None)
            if self.log_level is not None:
                tokenizer = getattr(state, "tokenizer", None)
                logger.info("%s", log_line(record, model, self.log_level, tokenizer))
            if self.tracer is not None:
                self.tracer.export(record, model)
        except Exception:  # noqa: BLE001 - observing a request must never fail it
            logger.exception("could not report request %s", ",".join(record.rids))


def log_line(record: RequestRecord, model: str | None, level: str, tokenizer: Any) -> str:
    """`request rid=... route=... ...`: one line, values quoted where they hold spaces or
    quotes (a client's rid is free text)."""
    fields: list[tuple[str, Any]] = [
        ("rid", ",".join(record.rids)), ("route", record.route), ("model", model),
        ("prompt_tokens", record.prompt_tokens),
        ("completion_tokens", record.completion_tokens),
        ("finish_reason", ",".join(record.finish_reasons) or None),
        ("latency", f"{record.latency_s:.3f}s"), ("client", record.client),
        ("status", record.status),
    ]
    line = "request " + " ".join(f"{name}={_value(v)}" for name, v in fields)
    if level == "full":
        prompts = [_text(p, tokenizer) for p in _distinct_prompts(record)]
        outputs = ["".join(r.text_parts) for r in record.requests.values()]
        line += f" prompt={_json(prompts)} output={_json(outputs)}"
    return line


def _value(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return text if _PLAIN_VALUE.fullmatch(text) else json.dumps(text, ensure_ascii=False)


def _json(items: list[str]) -> str:
    return json.dumps(items[0] if len(items) == 1 else items, ensure_ascii=False)


def _distinct_prompts(record: RequestRecord) -> list[Any]:
    seen: dict[int, Any] = {}
    for prompt in record.submitted.values():
        seen.setdefault(id(prompt), prompt)
    return list(seen.values())


def _text(prompt: Any, tokenizer: Any) -> str:
    """A prompt as text: chat routes submit token ids, which are decoded for the log."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and tokenizer is not None:
        try:
            return tokenizer.decode(prompt)
        except Exception:  # noqa: BLE001 - the ids themselves then
            pass
    return str(prompt)
