"""The process-wide default backend (SGLang's `sgl.global_config`) and its set/get functions."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    """Mutable settings shared by every program in this process.

    `default_backend` is what `run()` uses when given no `backend=`; `set_default_backend(b)`
    and `global_config.default_backend = b` are the same thing.
    """

    def __init__(self) -> None:
        self.default_backend: Any = None


global_config = GlobalConfig()


def set_default_backend(backend: Any) -> None:
    """Make `backend` the one programs use when run() gets no backend= (global_config's)."""
    global_config.default_backend = backend


def get_default_backend() -> Any:
    """The backend set by set_default_backend, or None."""
    return global_config.default_backend


def _backend_or_default(backend: Any) -> Any:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError("no backend: pass backend= or call set_default_backend(...) first")
    return backend
