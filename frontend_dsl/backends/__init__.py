"""Backends that run DSL programs: over HTTP, in-process, or on an OpenAI-compatible server."""

from frontend_dsl.backends.base import Backend, NativeBackend
from frontend_dsl.backends.openai_backend import OpenAI
from frontend_dsl.backends.runtime import Runtime
from frontend_dsl.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "NativeBackend", "OpenAI", "Runtime", "RuntimeEndpoint"]
