"""SGLang's `sglang.lang.backend.runtime_endpoint`: the backend over the native HTTP API."""

from frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["RuntimeEndpoint"]
