"""The FastAPI app: routes, API-key middleware, error mapping (never a 500 for a bad request),
and the OpenAPI document at /openapi.json (see server/openapi.py)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.config import ServerArgs
from sglang_like.server import (
    anthropic_api,
    dashboard,
    disaggregation_api,
    lora_api,
    native_api,
    ollama_api,
    openapi,
    tokenize_api,
    tracing,
)
from sglang_like.server.auth import SecurityMiddleware
from sglang_like.server.errors import ApiError, error_response
from sglang_like.server.metrics import CONTENT_TYPE
from sglang_like.server.openai import responses as openai_responses
from sglang_like.server.openai import router as openai_router
from sglang_like.server.runner import ClientGone
from sglang_like.server.state import ServerState, get_state

logger = logging.getLogger(__name__)


def create_app(engine: Any, server_args: ServerArgs | None = None) -> FastAPI:
    """An app serving `engine`; `server_args` defaults to the engine's own.

    The app does not own the engine: whoever built it shuts it down (see launch_server).
    """
    state = ServerState.build(engine, server_args)
    history = dashboard.StatsHistory(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        history.start()  # the dashboard's charts have the server's past when first opened
        # the engine's outputs are read on this loop, which streams them (Engine's docstring)
        attach = getattr(engine, "attach_event_loop", None)
        attached = attach is not None and attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            if attached:
                engine.detach_event_loop()
            history.stop()

    # Routes return their own Response objects; the plain class keeps FastAPI from documenting
    # a JSON body no route sends (each route states its responses, see server/openapi.py).
    app = FastAPI(
        title="sglang_like", version=_version(), docs_url=None, redoc_url=None,
        openapi_url="/openapi.json", default_response_class=Response, lifespan=lifespan,
    )
    app.state.server = state
    app.state.dashboard_history = history
    app.state.dashboard_trees = {}  # /cache_tree's last answers (server/dashboard/routes.py)
    app.include_router(native_api.router)
    app.include_router(openai_router)
    app.include_router(tokenize_api.router)
    app.include_router(dashboard.router)
    app.include_router(disaggregation_api.router)
    app.include_router(lora_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(ollama_api.router)
    app.include_router(openai_responses.router)
    metrics_doc = openapi.operation(ok={CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}})
    app.add_api_route("/metrics", _metrics, methods=["GET"], name="metrics",
                      openapi_extra=metrics_doc)
    openapi.install(app)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(ValueError, _on_value_error)
    app.add_exception_handler(Exception, _on_unexpected)
    # always: Host/Origin, media type and body size are checked with or without keys
    app.add_middleware(SecurityMiddleware, server_args=state.server_args)
    tracing.install(app, state.server_args)  # --log-requests, --otlp-traces-endpoint
    return app


def _version() -> str:
    try:
        return importlib.metadata.version("sglang-like")
    except importlib.metadata.PackageNotFoundError:
        return "0"


async def _metrics(request: Request) -> Response:
    state = get_state(request)
    try:
        # on a worker thread: the engine answers between steps, and a long prefill step must
        # not stall the event loop that streams everyone's tokens
        state.metrics.refresh_gauges(await run_in_threadpool(state.engine.get_server_info))
    except Exception:  # noqa: BLE001 - a dead engine: the counters still tell what happened
        logger.warning("/metrics without the engine's gauges", exc_info=True)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status_code >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc)
    return error_response(exc.status_code, exc.message, exc.param)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    """Nobody reads this answer; 499 (nginx's "client closed request") is for the logs."""
    return Response(status_code=499)


async def _on_value_error(request: Request, exc: Exception) -> Response:
    """The engine raises ValueError for bad user input (params, prompt length, grammar)."""
    get_state(request).metrics.observe_rejected(400)
    return error_response(400, str(exc) or type(exc).__name__)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # the exception's text may carry paths, peers or another request's data: it goes to the
    # log under an id, and the client gets the id
    error_id = uuid.uuid4().hex[:12]
    logger.exception("unhandled error %s on %s %s", error_id, request.method, request.url.path)
    return error_response(500, f"internal error (id {error_id} in the server log)")
