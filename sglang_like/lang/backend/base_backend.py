"""SGLang's `sglang.lang.backend.base_backend`: the backend contract (BaseBackend = Backend)."""

from frontend_dsl.backends.base import Backend

BaseBackend = Backend

__all__ = ["Backend", "BaseBackend"]
