"""API-key check as pure ASGI middleware; streams stay intact.

The key goes as `Authorization: Bearer <key>` (API clients), or as the password of HTTP Basic
auth with any user name: a browser cannot add a Bearer header when it opens /dashboard, but it
asks for Basic credentials when challenged and sends them again with the page's own requests.
"""

from __future__ import annotations

import base64
import binascii
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
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value.strip()
                break
        if not self._accepts(given):
            response = error_response(401, "missing or invalid API key (Authorization: Bearer "
                                      "<key>, or Basic auth with the key as the password)")
            # two challenges: API clients read Bearer; a browser asks its user for Basic
            response.headers.append("WWW-Authenticate", "Bearer")
            response.headers.append("WWW-Authenticate", 'Basic realm="sglang_like", '
                                    'charset="UTF-8"')
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _accepts(self, given: bytes) -> bool:
        if given[:7].lower() == b"bearer ":
            return hmac.compare_digest(b"Bearer " + given[7:].strip(), self._expected)
        if given[:6].lower() == b"basic ":
            try:
                decoded = base64.b64decode(given[6:].strip(), validate=True)
            except (binascii.Error, ValueError):
                return False
            _, sep, password = decoded.partition(b":")
            return bool(sep) and hmac.compare_digest(password, self._key)
        return False
