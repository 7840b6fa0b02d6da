"""Shared fixtures: the default model's weights loaded once per test session."""

from __future__ import annotations

import functools
import weakref

import pytest

import sglang_like.engine as engine_mod
import sglang_like.engine_core.setup as setup_mod
from sglang_like.model_loader import load_model


@functools.lru_cache(maxsize=3)
def _cached_load(model_path, dtype, keep_packed=False):
    return load_model(model_path, dtype, keep_packed)


@pytest.fixture(scope="session")
def make_engine():
    """Build Engines with different knobs without reloading the weights each time."""
    original = setup_mod.load_model
    setup_mod.load_model = _cached_load
    # weak: an engine its test has let go of is freed then (its KV pool and packed weights
    # are hundreds of MB; held to the session's end, a suite's worth outgrew the machine)
    engines: list[weakref.ref] = []

    def factory(**kwargs):
        kwargs.setdefault("max_total_tokens", 16384)
        # the core on a thread of this process: the tests look inside the scheduler and share
        # the weights loaded once (test_engine_process.py covers the engine process)
        kwargs.setdefault("engine_in_process", True)
        e = engine_mod.Engine(**kwargs)
        engines.append(weakref.ref(e))
        return e

    yield factory
    for ref in engines:
        if (e := ref()) is not None:
            e.shutdown()
    setup_mod.load_model = original
