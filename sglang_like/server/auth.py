"""The HTTP edge's checks, as one pure ASGI middleware (streams stay intact): Host and Origin
(DNS rebinding, cross-site posts), the method and media type of state changes, the body size,
and who is asking (API keys).

Keys go as `Authorization: Bearer <key>` (API clients), as `x-api-key: <key>` (Anthropic's
clients; read only when there is no Authorization header), or as the password of HTTP Basic
auth with any user name: a browser cannot add a Bearer header when it opens /dashboard, but it
asks for Basic credentials when challenged and sends them again with the page's own requests.

Two kinds of key. A plain key (`--api-key`, or each line of `--api-key-file`) serves
generation, tokenizing and model info; each plain key is a tenant of its own (its requests
share no cached prefix with another key's, and it aborts only its own requests). The admin key
(`--admin-api-key`) also reaches what is the operator's: the routes in `ADMIN_PATHS`, aborting
others' or all requests. With no key configured at all the server is open (a loopback dev
server) and every caller is the operator; with a plain key but no admin key, the operator's
routes are refused to everyone.

`--max-concurrent-requests-per-key N` bounds each plain key's generating requests in flight
(`KeyLimits`): one more is a 429 with Retry-After, and other keys are not affected.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang_like.config import ServerArgs
from sglang_like.server.errors import ApiError, error_response

# Routes a load balancer or supervisor probes without credentials.
OPEN_PATHS = frozenset({"/health"})
# The operator's routes: they change the server's state or show what other users sent.
ADMIN_PATHS = frozenset({
    "/flush_cache", "/switch_disaggregation_mode", "/metrics", "/dashboard", "/stats",
    "/cache_tree", "/cache_match", "/load_lora_adapter", "/unload_lora_adapter",
})
_ADMIN_PREFIXES = ("/dashboard/", "/cache_tree/")
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the operator or not, and the tenant its requests belong to (None:
    the one tenant of a server without keys)."""

    is_admin: bool
    tenant: str | None


OPEN_SERVER = Principal(is_admin=True, tenant=None)


def principal_of(scope: Scope) -> Principal:
    """The caller the middleware found (an app without the middleware: an open server)."""
    return (scope.get("state") or {}).get("principal", OPEN_SERVER)


# seconds a client refused for its key's limit is told to wait (when one of its requests
# ends is not known; a generation on this runtime takes about that long)
_RETRY_AFTER_S = 1


class KeyLimits:
    """Generating requests in flight per plain API key (--max-concurrent-requests-per-key).

    An HTTP request holds one slot from the moment it first submits to the engine (the
    runner calls `take_key_slot`, however many engine requests it fans out to) until its
    response has been sent, a stream's included (the middleware gives the slot back). The
    admin key and an open server's callers are not limited. Only the event loop's thread
    touches it."""

    def __init__(self, max_per_key: int | None) -> None:
        self.max_per_key = max_per_key
        self.num_inflight: collections.Counter[str] = collections.Counter()

    def take(self, scope: Scope) -> None:
        """Count the scope's request against its key; ApiError(429) when the key is at its
        limit (the middleware then adds Retry-After). Taking twice is taking once."""
        state = scope.setdefault("state", {})
        principal = principal_of(scope)
        if (self.max_per_key is None or principal.is_admin or principal.tenant is None
                or "key_slot" in state):
            return
        tenant = principal.tenant
        if self.num_inflight[tenant] >= self.max_per_key:
            state["key_refused"] = True
            raise ApiError(429, f"this API key has {self.num_inflight[tenant]} requests in "
                                f"flight, its limit (--max-concurrent-requests-per-key "
                                f"{self.max_per_key}); retry when one has finished")
        self.num_inflight[tenant] += 1
        state["key_slot"] = tenant

    def give_back(self, scope: Scope) -> None:
        tenant = (scope.get("state") or {}).pop("key_slot", None)
        if tenant is not None:
            self.num_inflight[tenant] -= 1
            if not self.num_inflight[tenant]:
                del self.num_inflight[tenant]


def take_key_slot(scope: Scope) -> None:
    """Count a request that starts generating against its API key's limit (ApiError(429)
    past it); nothing where the app runs without the middleware or the limit."""
    limits = (scope.get("state") or {}).get("key_limits")
    if limits is not None:
        limits.take(scope)


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(_ADMIN_PREFIXES)


def key_tenant(key: str) -> str:
    """A key's tenant name: a digest, so no log or cache view carries the key itself."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def allowed_host_names(args: ServerArgs) -> frozenset[str] | None:
    """Host names the server answers to (None: any). A loopback server answers only to
    loopback names by default: a page on another site whose name is rebound to 127.0.0.1
    sends its own name as Host, and is refused."""
    if args.allowed_hosts:
        names = {h.strip().lower().strip("[]") for h in args.allowed_hosts if h.strip()}
        return None if "*" in names else frozenset(names)
    host = args.host.strip("[]")
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    return frozenset(_LOOPBACK_NAMES) | {host.lower()} if is_loopback else None


def _hostname(value: str) -> str:
    """The name of a Host header value ("name:port", "[::1]:port")."""
    return (urlsplit("//" + value).hostname or "").lower()


class SecurityMiddleware:
    """Every HTTP request passes here first; a refusal is a JSON error that names the cause."""

    def __init__(self, app: ASGIApp, server_args: ServerArgs) -> None:
        self.app = app
        self.max_body = server_args.max_request_body_bytes
        self.hosts = allowed_host_names(server_args)
        # constant-time compares against every key; the admin key is checked first
        self.admin_key = (server_args.admin_api_key or "").encode() or None
        keys = [server_args.api_key, *server_args.extra_api_keys]
        self.keys = [(k.encode(), key_tenant(k)) for k in keys if k]
        self.is_open = self.admin_key is None and not self.keys
        limit = getattr(server_args, "max_concurrent_requests_per_key", None)
        self.key_limits = KeyLimits(limit) if limit is not None and not self.is_open else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name: value for name, value in scope.get("headers", [])}
        path = scope.get("path", "")
        refusal = self._check_origin(headers)
        if refusal is None:
            principal, refusal = self._authenticate(path, headers)
        if refusal is None and scope["method"] == "POST":
            refusal = _check_media_type(headers)
        if refusal is None:
            refusal = self._check_length(headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, self.max_body)
            if body is None:
                await error_response(413, f"request body over {self.max_body} bytes "
                                          "(--max-request-body-bytes)")(scope, receive, send)
                return
            receive = _replay(body, receive)
        if self.key_limits is None:
            await self.app(scope, receive, send)
            return
        scope["state"]["key_limits"] = self.key_limits
        try:
            await self.app(scope, receive, _retry_after_on_refusal(scope, send))
        finally:
            self.key_limits.give_back(scope)

    # ---- the checks: each returns the refusal, or None -------------------------------------
    def _check_origin(self, headers: dict[bytes, bytes]) -> object | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and _hostname(host) not in self.hosts:
            return error_response(421, f"Host {host!r} is not served here (--allowed-hosts)")
        origin = headers.get(b"origin")
        if origin is None:
            return None
        # a browser sends Origin on cross-site posts: only the server's own pages may post
        parts = urlsplit(origin.decode("latin-1"))
        if parts.netloc.lower() == host.lower():
            return None
        if self.hosts is not None and (parts.hostname or "").lower() in self.hosts:
            return None
        return error_response(403, f"requests from the page at {origin.decode('latin-1')!r} "
                                   "are not accepted (cross-origin)")

    def _authenticate(self, path: str, headers: dict[bytes, bytes]
                      ) -> tuple[Principal, object | None]:
        if self.is_open:
            return OPEN_SERVER, None
        principal = self._principal(_given_key(headers))
        if path in OPEN_PATHS:
            return principal or Principal(False, None), None
        if principal is None:
            response = error_response(401, "missing or invalid API key (Authorization: Bearer "
                                      "<key>, x-api-key: <key>, or Basic auth with the key as "
                                      "the password)")
            # two challenges: API clients read Bearer; a browser asks its user for Basic
            response.headers.append("WWW-Authenticate", "Bearer")
            response.headers.append("WWW-Authenticate", 'Basic realm="sglang_like", '
                                    'charset="UTF-8"')
            return principal, response
        if is_admin_path(path) and not principal.is_admin:
            why = ("this route needs the admin API key" if self.admin_key else
                   "this route needs the admin API key, and none is configured "
                   "(--admin-api-key)")
            return principal, error_response(403, why)
        return principal, None

    def _principal(self, given: bytes) -> Principal | None:
        password = _credential(given)
        if password is None:
            return None
        found = None
        # every key is compared (constant time each), so timing tells nothing of which matched
        if self.admin_key is not None and hmac.compare_digest(password, self.admin_key):
            found = Principal(True, "admin")
        for key, tenant in self.keys:
            if hmac.compare_digest(password, key) and found is None:
                found = Principal(False, tenant)
        return found

    def _check_length(self, headers: dict[bytes, bytes]) -> object | None:
        raw = headers.get(b"content-length")
        if raw is None:
            return None
        try:
            length = int(raw)
        except ValueError:
            return error_response(400, "Content-Length is not a number")
        if length > self.max_body:
            return error_response(413, f"request body of {length} bytes is over "
                                       f"{self.max_body} (--max-request-body-bytes)")
        return None


def _given_key(headers: dict[bytes, bytes]) -> bytes:
    """The Authorization header, or else Anthropic's `x-api-key: <key>` as a Bearer key."""
    given = headers.get(b"authorization", b"").strip()
    if not given and (api_key := headers.get(b"x-api-key", b"").strip()):
        return b"Bearer " + api_key
    return given


def _credential(given: bytes) -> bytes | None:
    if given[:7].lower() == b"bearer ":
        return given[7:].strip()
    if given[:6].lower() == b"basic ":
        try:
            decoded = base64.b64decode(given[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        _, sep, password = decoded.partition(b":")
        return password if sep else None
    return None


def _check_media_type(headers: dict[bytes, bytes]) -> object | None:
    """Every POST body here is JSON; a form or text/plain post (what a cross-site page can
    send without a preflight) is refused before it is read."""
    raw = headers.get(b"content-type", b"").decode("latin-1")
    media = raw.split(";", 1)[0].strip().lower()
    if not media and headers.get(b"content-length", b"0").strip() == b"0" and (
            b"transfer-encoding" not in headers):
        return None  # no body at all (SGLang's clients post /flush_cache so)
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return None
    return error_response(415, f"POST bodies must be application/json, got "
                               f"{media or 'no Content-Type'!r}")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body (None once it passes `limit`: a chunked upload has no Content-Length)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # the client left: the app sees an empty body, then the disconnect
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _retry_after_on_refusal(scope: Scope, send: Send) -> Send:
    """A send that adds Retry-After to the response of a request its key's limit refused."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and scope["state"].get("key_refused"):
            headers = [*message.get("headers", []),
                       (b"retry-after", str(_RETRY_AFTER_S).encode())]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read here, then the client's later messages
    (a disconnect, which the routes watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
