"""Shared fixtures for tests/constrained: the real SmolLM2 vocabulary and one backend each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from constrained_testlib import smollm_tokenizer_info  # noqa: E402

from constrained import GRAMMAR_BACKENDS, GrammarBackend, TokenizerInfo  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_info() -> TokenizerInfo:
    return smollm_tokenizer_info()


@pytest.fixture(scope="session")
def backends(tokenizer_info: TokenizerInfo) -> dict[str, GrammarBackend]:
    built = {name: GrammarBackend(tokenizer_info, backend=name) for name in GRAMMAR_BACKENDS}
    yield built
    for backend in built.values():
        backend.shutdown()
