"""API-key check (Authorization: Bearer <key>) as pure ASGI middleware; streams stay intact."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from sglang_like.server.errors import error_response

# Routes a load balancer or supervisor probes without credentials.
_OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Refuse every HTTP request but the open paths unless it carries the key (constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value.strip()
                break
        if not hmac.compare_digest(given, self._expected):
            response = error_response(401, "missing or invalid API key (Authorization: Bearer)")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
