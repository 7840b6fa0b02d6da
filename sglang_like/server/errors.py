"""Errors at the HTTP edge: one exception type, two wire shapes (native and OpenAI), safe JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    421: "MisdirectedRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request that cannot be served: carries the HTTP status and a message for the client."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; the native routes use it too (SGLang's clients read `message`)."""
    return {
        "error": {
            "message": message,
            "type": _STATUS_TYPES.get(status_code, "Error"),
            "param": param,
            "code": status_code,
        }
    }


def error_response(status_code: int, message: str, param: str | None = None) -> Response:
    return json_response(error_body(status_code, message, param), status_code=status_code)


def to_jsonable(obj: Any) -> Any:
    """Replace non-finite floats (a -inf logprob) by None so the body stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict, compact JSON; falls back to sanitizing only when a non-finite float is present."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(to_jsonable(obj), ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(dumps(obj), status_code=status_code, media_type="application/json")


async def read_json_body(request: Request) -> Any:
    """The request body as JSON; ApiError(400) for bytes that are not UTF-8 or not JSON."""
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def pydantic_message(exc: Exception) -> str:
    """One line per field error of a pydantic ValidationError: `loc: msg`."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors(include_url=False):
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or str(exc)
