"""Calls into the Engine on behalf of HTTP requests: admission (429: a full queue, or a key
past its limit of requests in flight), rids, disconnects, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request

from sglang_like.engine_core.loop import is_derived_rid
from sglang_like.server.auth import Principal, principal_of, take_key_slot
from sglang_like.server.errors import ApiError
from sglang_like.server.metrics import ServerMetrics
from sglang_like.server.request_log import observe_call, observe_output

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


def new_rid() -> str:
    return uuid.uuid4().hex


_MAX_RID_CHARS = 256


def check_rid(rid: str) -> None:
    """A client's rid: printable, bounded (it goes into logs and answers verbatim)."""
    if not rid or len(rid) > _MAX_RID_CHARS or not rid.isprintable():
        raise ApiError(400, f"rid must be 1 to {_MAX_RID_CHARS} printable characters", "rid")


class EngineStream:
    """One streamed engine request: relays its delta chunks, observes metrics, aborts on close.

    Chunks are the engine's (text and output ids are deltas, counts cumulative). `aclose()` is
    safe to call at any time and more than once; a stream closed before its final chunk is
    aborted in the engine so its KV slots are freed.
    """

    def __init__(self, runner: EngineRunner, it: AsyncIterator[dict], rid: str, t0: float) -> None:
        self._runner = runner
        self._it = it
        self.rid = rid
        self._t_start = t0
        self._t_last = t0
        self._num_tokens = 0
        self._pending: dict | None = None
        self.is_finished = False
        self._is_closed = False

    async def prime(self) -> None:
        """Wait for the first chunk, so that a bad request raises before any byte is sent
        (and one the engine's full queue dropped is the 429 it is)."""
        self._pending = await self._next_chunk()
        refusal = queue_refusal(self._pending)
        if refusal is not None:
            self._runner.metrics.observe_rejected(429)
            raise refusal

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> dict:
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return chunk
        if self.is_finished or self._is_closed:
            raise StopAsyncIteration
        return await self._next_chunk()

    async def _next_chunk(self) -> dict:
        chunk = await self._it.__anext__()
        self._observe(chunk)
        return chunk

    def _observe(self, chunk: dict) -> None:
        observe_output(chunk)  # the request log and trace (server/request_log.py)
        now = time.perf_counter()
        meta = chunk.get("meta_info") or {}
        num_tokens = int(meta.get("completion_tokens") or 0)
        new_tokens = num_tokens - self._num_tokens
        metrics = self._runner.metrics
        if new_tokens > 0:
            if self._num_tokens == 0:
                metrics.time_to_first_token.observe(now - self._t_start)
            else:
                metrics.observe_itl((now - self._t_last) / new_tokens, new_tokens)
            self._num_tokens = num_tokens
            self._t_last = now
        if meta.get("finish_reason") is not None:
            self.is_finished = True
            metrics.observe_finished(meta)

    async def aclose(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._runner.num_inflight -= 1
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await self._it.aclose()
        if not self.is_finished:
            self._runner.abort(self.rid)
        self._runner.release([self.rid])


class EngineRunner:
    """The server's one door into the engine."""

    def __init__(
        self, engine: Any, metrics: ServerMetrics, max_queued_requests: int,
        max_running_requests: int, cross_tenant_cache: bool = False,
    ) -> None:
        self.engine = engine
        self.cross_tenant_cache = cross_tenant_cache
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.max_running_requests = max_running_requests
        # under priority scheduling the engine bounds its queue itself: it alone knows whose
        # priority is the lowest there, whom a full queue drops
        server_args = getattr(engine, "server_args", None)
        self.engine_bounds_queue = bool(getattr(server_args, "enable_priority_scheduling",
                                                False))
        self.num_inflight = 0  # engine requests this server has submitted and not yet seen end
        # live rids this server submitted -> the tenant that sent them (who may abort them)
        self.owners: dict[str, str | None] = {}

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch slot: the engine's count, or more if we know better.

        Submissions reach the engine's queue asynchronously, so a burst could all pass a check
        of the engine's count alone; requests in flight beyond the running cap must be waiting.
        """
        num_queued = int(getattr(self.engine, "num_queued_requests", 0) or 0)
        return max(num_queued, self.num_inflight - self.max_running_requests)

    def check_capacity(self, num_new: int = 1, request: Request | None = None) -> None:
        """429 at once when the waiting queue cannot take `num_new` more requests (a request's
        whole fan-out: n samples of each prompt), instead of letting the client hang; or
        when the caller's API key has its limit of requests in flight (`request`: the HTTP
        request, which then holds a slot of its key's until its response has been sent)."""
        if request is not None:
            try:
                take_key_slot(request.scope)
            except ApiError:
                self.metrics.observe_rejected(429)
                raise
        if self.engine_bounds_queue:
            return
        num_queued = self.num_waiting
        free = max(0, self.max_running_requests - self.num_inflight)
        if num_queued + max(0, num_new - free) > self.max_queued_requests:
            self.metrics.observe_rejected(429)
            raise ApiError(
                429,
                f"server overloaded: {num_queued} requests waiting, {num_new} more asked "
                f"(--max-queued-requests {self.max_queued_requests}); retry later",
            )

    def claim(self, rids: list[str], owner: str | None, given: bool) -> None:
        """Record who owns `rids`. A rid the client chose must not be in use, nor be one of
        the engine's derived rids (`rid-0`) of another's request or their parent: aborting a
        rid reaches those too, so a tenant could otherwise end another's requests."""
        if given:
            for rid in rids:
                check_rid(rid)
            live = set(self.owners)
            for rid in rids:
                for other in live:
                    if other == rid or ((is_derived_rid(other, rid)
                                         or is_derived_rid(rid, other))
                                        and self.owners[other] != owner):
                        raise ApiError(400, f"rid {rid!r} is in use by a running request",
                                       "rid")
            if len(set(rids)) != len(rids):
                raise ApiError(400, "a rid is given to more than one request", "rid")
        for rid in rids:
            self.owners[rid] = owner

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.owners.pop(rid, None)

    def tenant_salt(self, call: dict[str, Any], tenant: str | None) -> None:
        """Set the call's cache salt: the caller's tenant (unless the operator lets tenants
        share the cache) joined with the request's own `cache_salt`."""
        parts = [] if self.cross_tenant_cache or tenant is None else [tenant]
        if call.get("cache_salt"):
            parts.append("salt:" + call["cache_salt"])
        call["cache_salt"] = "\n".join(parts) or None

    def abort_for(self, rid: str, principal: Principal) -> bool:
        """/abort_request of one rid: the operator's reaches any request; a tenant's only its
        own (and their derived rids). False: no such request of the caller's."""
        if not principal.is_admin:
            mine = any(who == principal.tenant and (live == rid or is_derived_rid(rid, live))
                       for live, who in self.owners.items())
            if not mine:
                return False
        self.abort(rid)
        return True

    def abort(self, rid: str | list[str]) -> None:
        for one in [rid] if isinstance(rid, str) else rid:
            try:
                self.engine.abort(one)
            except Exception:  # noqa: BLE001 - the request may have finished meanwhile
                logger.debug("abort of %s failed", one, exc_info=True)

    async def generate(
        self, request: Request | None, calls: list[dict[str, Any]]
    ) -> list[dict | list[dict]]:
        """Run non-streamed engine calls concurrently; abort them all if the client goes away.

        Each call is a dict of `Engine.generate` keyword arguments; the answer has one engine
        result per call. A ValueError from the engine propagates (the edge makes it a 400).
        """
        num_requests = sum(_num_requests(call) for call in calls)
        self.check_capacity(num_requests, request)
        owner = principal_of(request.scope).tenant if request is not None else None
        rids: list[str] = []
        given = False
        for call in calls:
            self.tenant_salt(call, owner)
            given = given or bool(call.get("rid"))
            call["rid"] = call.get("rid") or _rids_for(call)
            observe_call(call["rid"], call)
            rids += call["rid"] if isinstance(call["rid"], list) else [call["rid"]]
        self.claim(rids, owner, given)
        self.num_inflight += num_requests
        # the calls' requests reach the scheduler together (a list of prompts, n choices:
        # prefilled in one batch however the loop is timed); a call that fails (a bad prompt
        # of a batch) ends the others at once: the batch fails whole, and nothing it started
        # runs on for nobody
        task = asyncio.ensure_future(self.engine.async_generate_calls(
            [{**call, "stream": False} for call in calls]))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                self._cancel(task, calls)
                raise ClientGone()
            results = task.result()  # the engine aborted every call if one failed
        except asyncio.CancelledError:
            self._cancel(task, calls)
            raise
        finally:
            watcher.cancel()
            self.num_inflight -= num_requests
            self.release(rids)
        items = [item for result in results
                 for item in (result if isinstance(result, list) else [result])]
        refusal = next((r for item in items if (r := queue_refusal(item)) is not None), None)
        if refusal is not None:  # a full queue dropped a part (priority scheduling): all 429
            self.metrics.observe_rejected(429)
            raise refusal
        for item in items:
            self.metrics.observe_finished(item.get("meta_info") or {})
            observe_output(item)
        return results

    def _cancel(self, task: asyncio.Future, calls: list[dict[str, Any]]) -> None:
        if not task.done():
            task.cancel()
            for call in calls:
                self.abort(call["rid"])

    async def open_stream(self, owner: str | None = None, **kwargs: Any) -> EngineStream:
        """Start one streamed engine request (a single prompt, n=1) and wait for its first chunk;
        `owner`: the tenant that sent it."""
        self.check_capacity()
        given = kwargs.pop("rid", None)
        rid = given or new_rid()
        self.tenant_salt(kwargs, owner)
        self.claim([rid], owner, bool(given))
        observe_call(rid, kwargs)
        t0 = time.perf_counter()
        self.num_inflight += 1
        try:
            it = await self.engine.async_generate(stream=True, rid=rid, **kwargs)
        except BaseException:
            self.num_inflight -= 1
            self.release([rid])
            raise
        stream = EngineStream(self, it, rid, t0)
        try:
            await stream.prime()
        except BaseException:
            await stream.aclose()
            raise
        return stream


async def merge_streams(streams: list[EngineStream]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave streams as (index, chunk) in arrival order; closes all of them at the end."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, dict | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: EngineStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_live = len(streams)
        while num_live:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                num_live -= 1
                continue
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


def queue_refusal(output: dict) -> ApiError | None:
    """The 429 of an engine output whose request a full queue dropped before it started
    (priority scheduling bounds the queue in the engine); None for any other output."""
    reason = (output.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") == "abort" and reason.get("status_code") == 429:
        return ApiError(429, reason.get("message") or "the waiting queue is full")
    return None


def _num_requests(call: dict[str, Any]) -> int:
    prompt, input_ids = call.get("prompt"), call.get("input_ids")
    sampling = call.get("sampling_params")
    num_prompts = len(prompt) if isinstance(prompt, list) else (
        len(input_ids) if input_ids and isinstance(input_ids[0], list) else 1
    )
    params = sampling if isinstance(sampling, list) else [sampling or {}] * num_prompts
    return sum(int((p or {}).get("n", 1) or 1) for p in params)


def _rids_for(kwargs: dict[str, Any]) -> str | list[str]:
    prompt = kwargs.get("prompt")
    input_ids = kwargs.get("input_ids")
    if isinstance(prompt, list):
        return [new_rid() for _ in prompt]
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return [new_rid() for _ in input_ids]
    return new_rid()


async def wait_disconnect(request: Request | None) -> None:
    """Return when the client has gone; never returns for an in-process caller."""
    if request is None:
        await asyncio.Event().wait()
        return
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
