"""HTTP server: SGLang-native and OpenAI-compatible APIs over an `Engine`, with metrics and auth.

Build an app with `create_app(engine)` and serve it with uvicorn, or run
`python -m sglang_like.launch_server`.
"""

from __future__ import annotations

from sglang_like.server.app import create_app
from sglang_like.server.errors import ApiError
from sglang_like.server.metrics import ServerMetrics

__all__ = ["ApiError", "ServerMetrics", "create_app"]
