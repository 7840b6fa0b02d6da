"""Server-sent events: encoding, and a response that always closes its engine streams."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from sglang_like.server.auth import principal_of
from sglang_like.server.errors import ApiError, dumps, error_body
from sglang_like.server.runner import ClientGone, EngineRunner, EngineStream, wait_disconnect

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def open_streams(
    runner: EngineRunner, calls: list[dict[str, Any]], request: Request | None = None
) -> list[EngineStream]:
    """Open one engine stream per call, all at once; if any fails, close the others and raise.

    Opening waits for each stream's first chunk (its prefill, or its turn in the queue); a
    client that leaves meanwhile gets its requests aborted at once (ClientGone), not after
    they have been prefilled for nobody.
    """
    runner.check_capacity(len(calls), request)  # the whole fan-out, before any opens
    owner = principal_of(request.scope).tenant if request is not None else None
    tasks = [asyncio.ensure_future(runner.open_stream(owner, **call)) for call in calls]
    opening = asyncio.gather(*tasks, return_exceptions=True)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({opening, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _close_all(tasks)
        raise
    finally:
        watcher.cancel()
    if not opening.done():
        await _close_all(tasks)
        raise ClientGone()
    outcomes = opening.result()
    streams = [o for o in outcomes if isinstance(o, EngineStream)]
    errors = [o for o in outcomes if not isinstance(o, EngineStream)]
    if errors:
        for stream in streams:
            await stream.aclose()
        raise errors[0]
    return streams


async def _close_all(tasks: list[asyncio.Future]) -> None:
    """Cancel the openings still waiting (each aborts its request) and close the opened ones."""
    for task in tasks:
        task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.wait(tasks)
        for task in tasks:
            if task.cancelled() or task.exception() is not None:
                continue
            await task.result().aclose()


def _openai_error_event(status_code: int, message: str) -> str:
    return sse(error_body(status_code, message)) + DONE


def sse_response(
    events: AsyncIterator[str], streams: list[EngineStream], *,
    error_event: Callable[[int, str], str] = _openai_error_event,
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Stream `events`; a late error becomes `error_event(status, message)` (by default
    OpenAI's error event, then [DONE]); every stream is closed at the end. Other APIs'
    streams (Anthropic's events, Ollama's NDJSON) pass their own error shape and media type.

    Starlette cancels the body iterator when the client disconnects; the `finally` here then
    closes the engine streams, which aborts unfinished requests and frees their KV slots.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (ValueError, ApiError) as e:
            status = e.status_code if isinstance(e, ApiError) else 400
            yield error_event(status, str(e))
        except Exception:  # noqa: BLE001 - headers are sent; report in-band
            error_id = uuid.uuid4().hex[:12]
            logger.exception("stream failed (%s)", error_id)  # its text only in the log
            yield error_event(500, f"internal error (id {error_id} in the server log)")
        finally:
            for stream in streams:
                await stream.aclose()

    return StreamingResponse(
        body(),
        media_type=media_type,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
