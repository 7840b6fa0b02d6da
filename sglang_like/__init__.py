"""sglang_like: a structured-generation LLM runtime in the spirit of SGLang.

`import sglang_like as sgl` gives the frontend DSL (re-exported from `frontend_dsl`) and, lazily,
the runtime: `Engine`, `SamplingParams`, `ServerArgs`. Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

try:  # the DSL is optional while it is being built; it never imports torch
    from frontend_dsl import *  # noqa: F403
    from frontend_dsl import __all__ as _dsl_all
except ImportError:  # pragma: no cover
    _dsl_all = []

_LAZY = {
    "Engine": "sglang_like.engine",
    "SamplingParams": "sglang_like.sampling_params",
    "ServerArgs": "sglang_like.config",
    "ModelConfig": "sglang_like.config",
}

__all__ = [*_dsl_all, *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'sglang_like' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
