"""Server-sent events: encoding, and a response that always closes its engine streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from sglang_like.server.errors import ApiError, dumps, error_body
from sglang_like.server.runner import EngineRunner, EngineStream

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def open_streams(runner: EngineRunner, calls: list[dict[str, Any]]) -> list[EngineStream]:
    """Open one engine stream per call, all at once; if any fails, close the others and raise."""
    outcomes = await asyncio.gather(
        *(runner.open_stream(**call) for call in calls), return_exceptions=True
    )
    streams = [o for o in outcomes if isinstance(o, EngineStream)]
    errors = [o for o in outcomes if not isinstance(o, EngineStream)]
    if errors:
        for stream in streams:
            await stream.aclose()
        raise errors[0]
    return streams


def sse_response(
    events: AsyncIterator[str], streams: list[EngineStream]
) -> StreamingResponse:
    """Stream `events`; a late error becomes one error event; every stream is closed at the end.

    Starlette cancels the body iterator when the client disconnects; the `finally` here then
    closes the engine streams, which aborts unfinished requests and frees their KV slots.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (ValueError, ApiError) as e:
            status = e.status_code if isinstance(e, ApiError) else 400
            yield sse(error_body(status, str(e)))
            yield DONE
        except Exception as e:  # noqa: BLE001 - headers are sent; report in-band
            logger.exception("stream failed")
            yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
            yield DONE
        finally:
            for stream in streams:
                await stream.aclose()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
