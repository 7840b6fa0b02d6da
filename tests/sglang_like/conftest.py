"""Shared fixtures: the default model's weights loaded once per test session, and every
engine a test module makes shut down when that module ends."""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest

import sglang_like.engine as engine_mod
import sglang_like.engine_core.setup as setup_mod
from sglang_like.model_loader import load_model


@functools.lru_cache(maxsize=3)
def _cached_load(model_path, dtype, keep_packed=False):
    return load_model(model_path, dtype, keep_packed)


@pytest.fixture(scope="module", autouse=True)
def _engines_end_with_their_module() -> Any:
    """Shut down every Engine made while this module ran, when it ends.

    An engine a test lets go of without `shutdown()` is not freed: its core's loop thread
    (in-process engines) or process keeps the model, the KV pool and the packed weights, a
    few hundred MB each, and a suite's worth of them outgrew the machine (CI was killed at
    93% holding 8+ GB in the test process). Engines here never outlive their module."""
    made: list[Any] = []
    original = engine_mod.Engine.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    engine_mod.Engine.__init__ = init
    try:
        yield
    finally:
        engine_mod.Engine.__init__ = original
        for engine in reversed(made):
            engine.shutdown()  # a no-op for one already shut down
        made.clear()
        gc.collect()


@pytest.fixture(scope="session")
def make_engine():
    """Build Engines with different knobs without reloading the weights each time (each one
    is shut down at the end of the module that made it)."""
    original = setup_mod.load_model
    setup_mod.load_model = _cached_load

    def factory(**kwargs):
        kwargs.setdefault("max_total_tokens", 16384)
        # the core on a thread of this process: the tests look inside the scheduler and share
        # the weights loaded once (test_engine_process.py covers the engine process)
        kwargs.setdefault("engine_in_process", True)
        return engine_mod.Engine(**kwargs)

    yield factory
    setup_mod.load_model = original


@pytest.fixture(scope="session")
def tiny_llama() -> Any:
    """The weights of tiny_llama.TINY (tests that step a real model under the CUDA profile)."""
    from .tiny_llama import tiny_weights

    return tiny_weights()
