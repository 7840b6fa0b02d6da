"""A live view of the cache: the page at /dashboard and the JSON endpoints behind it."""

from sglang_like.server.dashboard.history import StatsHistory
from sglang_like.server.dashboard.routes import router

__all__ = ["StatsHistory", "router"]
