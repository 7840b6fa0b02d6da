"""Grammar compiles in capped, killable worker processes (issue #49): outlines' index of
`(a|b)*a(a|b){n}` grows about 3x per step of n; a compile of it stops at the worker's memory
cap or the timeout, the worker is killed (no thread or memory is kept), the engine's
backend answers InvalidGrammar and goes on compiling other specs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from constrained import Grammar, InvalidGrammar, TokenizerInfo
from sglang_like.engine_core.core import build_grammar_backend
from sglang_like.engine_core.grammar_isolation import IsolatedGrammarBackend

EXPLODING = "(a|b)*a(a|b){22}"


def _info() -> TokenizerInfo:
    vocab = [b"<eos>", b"a", b"b", b"ab", b"{", b"}", b'"', b":", b"0", b"1"]
    return TokenizerInfo(vocab=vocab, vocab_size=len(vocab), eos_token_ids=frozenset({0}),
                         special_token_ids=frozenset())


@pytest.fixture
def outlines() -> Iterator[IsolatedGrammarBackend]:
    backend = IsolatedGrammarBackend(_info(), "outlines", memory_limit_mb=200, num_threads=1,
                                     compile_timeout_s=6.0)
    yield backend
    backend.shutdown()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie until reaped: its state says so
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] == "Z"


def test_an_exploding_compile_is_stopped_and_its_worker_killed(
        outlines: IsolatedGrammarBackend) -> None:
    assert isinstance(outlines.compile("regex", "[ab]{3}"), Grammar)  # the worker is up
    (pid,) = outlines.worker_pids()
    t0 = time.monotonic()
    result = outlines.compile("regex", EXPLODING)
    assert isinstance(result, InvalidGrammar), result
    assert "memory" in result.message or "longer than" in result.message, result
    assert time.monotonic() - t0 < 6.0 + 5
    assert outlines.num_killed == 1
    deadline = time.monotonic() + 5
    while not _gone(pid):
        assert time.monotonic() < deadline, "the compile's process lives on"
        time.sleep(0.05)
    # the backend goes on: a fresh worker compiles the next spec
    assert isinstance(outlines.compile("regex", "a(b|a){2}"), Grammar)
    # a spec that fails to compile is an InvalidGrammar from the worker, nobody killed
    bad = outlines.compile("regex", "(unclosed")
    assert isinstance(bad, InvalidGrammar) and outlines.num_killed == 1


def test_xgrammar_compiles_through_a_worker() -> None:
    backend = IsolatedGrammarBackend(_info(), "xgrammar", memory_limit_mb=512,
                                     compile_timeout_s=30.0)
    try:
        assert isinstance(backend.compile("json", '{"type": "integer"}'), Grammar)
        assert isinstance(backend.compile("ebnf", 'root ::= "a" root | "b"'), Grammar)
        assert len(backend.worker_pids()) == 1
    finally:
        backend.shutdown()
    assert backend.worker_pids() == []


class _Tokenizer:
    special_token_ids = frozenset()

    def token_bytes_list(self) -> list[bytes]:
        return _info().vocab


def test_the_engine_builds_the_isolated_backend_unless_told_not_to() -> None:
    isolated = build_grammar_backend(_Tokenizer(), 10, frozenset({0}), "outlines", 256)
    plain = build_grammar_backend(_Tokenizer(), 10, frozenset({0}), "outlines", 0)
    try:
        assert isinstance(isolated, IsolatedGrammarBackend)
        assert isolated.memory_limit_mb == 256
        assert not isinstance(plain, IsolatedGrammarBackend)
    finally:
        isolated.shutdown()
        plain.shutdown()
