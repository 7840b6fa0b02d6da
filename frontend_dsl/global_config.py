"""The process-wide frontend settings (SGLang's `sgl.global_config`): the default backend."""

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
