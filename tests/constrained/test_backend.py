"""GrammarBackend and Grammar behaviour on both backends: errors, timeout, cache, masks."""

from __future__ import annotations

import json
import time

import pytest
from constrained_testlib import encode, load_smollm_vocab

from constrained import (
    GRAMMAR_BACKENDS,
    Grammar,
    GrammarBackend,
    InvalidGrammar,
    TokenizerInfo,
    allocate_token_bitmask,
    unpack_bitmask,
)

BAD_SPECS = [
    ("regex", "a(b"),
    ("regex", "[z-a]"),
    ("json", "{not json"),
    ("json", '{"type": "no-such-type"}'),
    ("kind-that-does-not-exist", "x"),
]


def allowed_ids(grammar: Grammar) -> set[int]:
    bitmask = allocate_token_bitmask(2, grammar.vocab_size)
    grammar.fill_next_token_bitmask(bitmask, 1)
    return set(unpack_bitmask(bitmask, grammar.vocab_size)[1].nonzero().flatten().tolist())


def token_id(text: str) -> int:
    return load_smollm_vocab()[0].index(text.encode())


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
@pytest.mark.parametrize(("kind", "spec"), BAD_SPECS)
def test_bad_spec_is_an_invalid_grammar_value(
    backends: dict[str, GrammarBackend], backend_name: str, kind: str, spec: str
) -> None:
    result = backends[backend_name].get_future(kind, spec).result(timeout=30)
    assert isinstance(result, InvalidGrammar) and result.message


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
def test_bad_spec_fails_alone_among_good_ones(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    backend = backends[backend_name]
    specs = [("regex", "[0-9]{2}"), ("json", '{"type": "bogus"}'), ("regex", "(yes|no)")]
    results = [f.result(timeout=30) for f in [backend.get_future(k, s) for k, s in specs]]
    assert [isinstance(r, Grammar) for r in results] == [True, False, True]


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
def test_specials_never_and_eos_only_when_accepting(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    info = backends[backend_name].tokenizer_info
    # "<|im_start|>" as plain text is allowed by this regex; the special token never is.
    grammar = backends[backend_name].compile("regex", r"(<\|im_start\|>|x)y?")
    assert isinstance(grammar, Grammar)
    allowed = allowed_ids(grammar)
    assert not allowed & (info.special_token_ids | info.eos_token_ids)
    assert not grammar.accept_token(1) and not grammar.accept_token(2)  # special, EOS
    assert grammar.accept_tokens(encode("<|im_start|>"))
    assert info.eos_token_ids <= allowed_ids(grammar) and grammar.is_accepting()
    assert not allowed_ids(grammar) & info.special_token_ids - info.eos_token_ids
    assert grammar.accept_token(2) and grammar.is_terminated()
    assert not grammar.accept_token(token_id("y")) and allowed_ids(grammar) == set()


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
def test_rollback_and_copy_restore_exact_state(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    grammar = backends[backend_name].compile(
        "json",
        json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}),
    )
    assert isinstance(grammar, Grammar)
    start = allowed_ids(grammar)
    ids = encode('{"k": 1') if backend_name == "xgrammar" else encode('{"k":1')
    assert grammar.accept_tokens(ids)
    snapshot = grammar.copy()
    mid = allowed_ids(grammar)
    assert grammar.accept_tokens(encode("}")) and grammar.accept_token(2)
    assert grammar.is_terminated() and not snapshot.is_terminated()
    assert allowed_ids(snapshot) == mid
    grammar.rollback(2)
    assert allowed_ids(grammar) == mid and grammar.num_accepted_tokens == len(ids)
    grammar.rollback(len(ids))
    assert allowed_ids(grammar) == start
    with pytest.raises(ValueError):
        grammar.rollback(1)


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
def test_refused_token_leaves_state_unchanged(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    grammar = backends[backend_name].compile("regex", "[0-9]+")
    assert isinstance(grammar, Grammar)
    before = allowed_ids(grammar)
    assert not grammar.accept_token(token_id("a"))
    assert not grammar.accept_tokens([token_id("1"), token_id("a")])
    assert grammar.num_accepted_tokens == 0 and allowed_ids(grammar) == before


def test_cache_compiles_once_and_hands_out_fresh_grammars(
    tokenizer_info: TokenizerInfo,
) -> None:
    backend = GrammarBackend(tokenizer_info, backend="outlines")
    calls = []
    compile_for_real = backend._compiler.compile
    backend._compiler.compile = lambda k, s: calls.append(s) or compile_for_real(k, s)
    first, second = backend.compile("regex", "ab"), backend.compile("regex", "ab")
    assert isinstance(first, Grammar) and isinstance(second, Grammar) and first is not second
    assert first.accept_token(token_id("ab")) and second.num_accepted_tokens == 0
    assert calls == ["ab"] and backend.cache_size() == 1
    backend.shutdown()


def test_slow_compile_times_out_into_invalid_grammar(tokenizer_info: TokenizerInfo) -> None:
    """A fake slow compiler (a real one cannot be stopped): the timeout is the unit here."""
    backend = GrammarBackend(tokenizer_info, backend="xgrammar", compile_timeout_s=0.2)
    compile_for_real = backend._compiler.compile
    backend._compiler.compile = lambda k, s: time.sleep(1.0) or compile_for_real(k, s)
    started = time.perf_counter()
    result = backend.compile("regex", "[ab]+")
    assert isinstance(result, InvalidGrammar) and "longer than 0.2s" in result.message
    assert time.perf_counter() - started < 0.9
    time.sleep(1.2)  # the compile finished in the background and filled the cache
    assert isinstance(backend.compile("regex", "[ab]+"), Grammar)
    backend.shutdown()


def test_outlines_refuses_what_it_cannot_enforce(backends: dict[str, GrammarBackend]) -> None:
    outlines = backends["outlines"]
    schema = json.dumps({"type": "integer", "minimum": 5})
    reason = outlines.supports("json", schema)
    assert isinstance(reason, str) and "minimum" in reason
    assert "minimum" in outlines.compile("json", schema).message
    assert isinstance(outlines.supports("ebnf", 'root ::= "a"'), str)
    assert backends["xgrammar"].supports("json", schema) is True
    # A property *named* like a keyword is not a keyword.
    named = json.dumps({"type": "object", "properties": {"minimum": {"type": "string"}}})
    assert outlines.supports("json", named) is True
