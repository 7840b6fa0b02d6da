"""Constrained decoding: regex / JSON-schema / EBNF specs -> per-request grammars -> token masks.

A leaf package: it takes plain tokenizer data (`TokenizerInfo`) and imports nothing from the
runtime. The scheduler owns one `Grammar` per constrained request, obtained from a
`GrammarBackend` ("xgrammar", the default, or "outlines": outlines-core's token index for
masks plus an interegular character FSM for jump-forward).
"""

from constrained.backend import GRAMMAR_BACKENDS, GrammarBackend
from constrained.base import GRAMMAR_KINDS, Grammar, InvalidGrammar, TokenizerInfo
from constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_, unpack_bitmask
from constrained.jump_forward import JumpForward, apply_jump_forward, plan_jump_forward

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "Grammar",
    "GrammarBackend",
    "InvalidGrammar",
    "JumpForward",
    "TokenizerInfo",
    "allocate_token_bitmask",
    "apply_jump_forward",
    "apply_token_bitmask_",
    "plan_jump_forward",
    "unpack_bitmask",
]


# Public names, one line each:
# GRAMMAR_BACKENDS  - the backend names GrammarBackend accepts ("xgrammar", "outlines").
# GRAMMAR_KINDS     - the spec kinds: "regex", "json" (a JSON-schema string), "ebnf",
#                     "structural_tag" (xgrammar's structural-tag JSON; xgrammar only).
# Grammar           - per-request constraint state: accept_token, rollback, masks, jump-forward.
# GrammarBackend    - compiles (kind, spec) in a thread pool with cache + timeout.
# InvalidGrammar    - the value a failed/unsupported/timed-out compile resolves to.
# JumpForward       - result of apply_jump_forward: (num_dropped, new_ids, forced).
# TokenizerInfo     - vocab bytes, logits width, EOS ids, special ids (plain data).
# allocate_token_bitmask - an all-allowed int32 [batch, ceil(vocab/32)] bitmask.
# apply_jump_forward     - move a grammar over its forced string; returns the token edit.
# apply_token_bitmask_   - logits[b, j] = -inf where bit j of bitmask[b] is clear (in place).
# plan_jump_forward      - retokenize the last k tokens + forced text canonically.
# unpack_bitmask         - bool [batch, vocab] view of a packed bitmask.
