"""Bitmask helpers against a plain reference, and the two backends' masks against each other."""

from __future__ import annotations

import pytest
import torch

from constrained import (
    Grammar,
    GrammarBackend,
    allocate_token_bitmask,
    apply_token_bitmask_,
    unpack_bitmask,
)
from constrained.bitmask import token_ids_to_words


@pytest.mark.parametrize(("batch", "vocab_size"), [(1, 1), (3, 33), (4, 100), (2, 49152)])
def test_apply_token_bitmask_matches_reference(batch: int, vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(batch * vocab_size)
    allowed = torch.rand((batch, vocab_size), generator=generator) < 0.3
    bitmask = allocate_token_bitmask(batch, vocab_size)
    for row in range(batch):
        bitmask[row] = token_ids_to_words(allowed[row].nonzero().flatten(), vocab_size)
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), allowed)
    logits = torch.randn((batch, vocab_size), generator=generator)
    expected = torch.where(allowed, logits, torch.full_like(logits, float("-inf")))
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)


def test_allocate_is_all_allowed_and_wider_logits_are_masked() -> None:
    bitmask = allocate_token_bitmask(2, 40)
    assert bitmask.shape == (2, 2) and unpack_bitmask(bitmask, 40).all()
    logits = torch.zeros((2, 70))
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits[:, :64]).all() and torch.isinf(logits[:, 64:]).all()
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros((3, 40)), bitmask)


# ASCII regexes whose meaning is identical in xgrammar and Rust's regex, including the ones
# outlines-core 0.2.x mis-indexes without our sentinel (optional tails after a final state).
AGREEING_REGEXES = [
    r"a*b?a",
    r"[0-9]{1,4}(\.5)?",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)",
    r"(yes|no|maybe)( please)?",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
]


def _allowed(grammar: Grammar) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, grammar.vocab_size)
    grammar.fill_next_token_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, grammar.vocab_size)[0]


@pytest.mark.parametrize("regex", AGREEING_REGEXES)
def test_backends_allow_the_same_tokens_at_every_step(
    backends: dict[str, GrammarBackend], regex: str
) -> None:
    xgr_grammar = backends["xgrammar"].compile("regex", regex)
    oc_grammar = backends["outlines"].compile("regex", regex)
    assert isinstance(xgr_grammar, Grammar) and isinstance(oc_grammar, Grammar)
    generator = torch.Generator().manual_seed(len(regex))
    for _ in range(3):
        steps = 0
        while not xgr_grammar.is_terminated() and steps < 40:
            allowed = _allowed(xgr_grammar)
            other = _allowed(oc_grammar)
            diff = (allowed ^ other).nonzero().flatten().tolist()
            assert not diff, f"masks differ on {len(diff)} tokens, e.g. {diff[:5]}"
            choices = allowed.nonzero().flatten()
            token = int(choices[torch.randint(len(choices), (1,), generator=generator)])
            assert xgr_grammar.accept_token(token) and oc_grammar.accept_token(token)
            steps += 1
        xgr_grammar.rollback(xgr_grammar.num_accepted_tokens)
        oc_grammar.rollback(oc_grammar.num_accepted_tokens)
