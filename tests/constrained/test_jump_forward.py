"""plan_jump_forward / apply_jump_forward: the text never changes, new ids are canonical."""

from __future__ import annotations

import json

import pytest
import torch
from constrained_testlib import decode, encode, sample_masked
from hypothesis import given, settings
from hypothesis import strategies as st

from constrained import Grammar, GrammarBackend, apply_jump_forward, plan_jump_forward

# Text pieces that merge across boundaries in byte-level BPE: spaces, digits, quotes,
# multi-byte characters (2-, 3- and 4-byte UTF-8), punctuation runs.
_PIECES = [
    "",
    " ",
    "  ",
    "\n",
    '"',
    '":',
    '", "',
    "{",
    "}",
    "1",
    "23",
    "é",
    "日本",
    "😀",
    "ab",
    " the",
    "ing",
    "::",
    "\t",
    "a b",
    "ß",
    "\u0301",
]
_text = st.lists(st.sampled_from(_PIECES) | st.text(max_size=4), max_size=6).map("".join)


@settings(max_examples=120, deadline=None)
@given(prefix=_text, forced=_text.filter(bool), partial=st.integers(0, 3))
def test_plan_keeps_text_and_is_canonical(prefix: str, forced: str, partial: int) -> None:
    ids = encode(prefix)
    if partial:  # end the output inside a 4-byte character
        emoji_bytes = encode("😀")
        ids = ids + emoji_bytes[: min(partial, len(emoji_bytes) - 1)]
    k, new_ids = plan_jump_forward(ids, forced, decode, encode)
    if decode(ids).endswith("\ufffd"):
        assert (k, new_ids) == (0, [])  # refusing is the only exact answer
        return
    if decode(ids + encode(forced)) != decode(ids) + forced:
        return  # not even plain appending is exact (the encoder cannot spell `forced`)
    assert new_ids, "appending is exact here, so some plan must be found"
    assert 0 <= k <= 2
    kept = ids[: len(ids) - k]
    assert decode(kept + new_ids) == decode(ids) + forced
    # Canonical: some suffix of the kept ids plus new_ids is the tokenizer's own encoding of
    # that region's text (shared leading tokens of the old tail are kept rather than re-sent).
    assert any(
        kept[len(kept) - s :] + new_ids == encode(decode(ids[len(kept) - s :]) + forced)
        for s in range(0, 3 - k)
        if s <= len(kept)
    )


@pytest.mark.parametrize(
    ("prefix", "forced"),
    [
        ("Hello", " world"),
        ('{"name', '": "'),
        ("x ", " y"),
        ("caf", "é"),
        ("12", "34"),
        ("日", "本語"),
        ("a  ", " b"),
    ],
)
def test_plan_merges_across_the_boundary(prefix: str, forced: str) -> None:
    ids = encode(prefix)
    k, new_ids = plan_jump_forward(ids, forced, decode, encode)
    assert ids[: len(ids) - k] + new_ids == encode(prefix + forced)


def test_plan_refuses_partial_character_and_empty_forced() -> None:
    emoji_ids = encode("😀")
    assert len(emoji_ids) > 1  # byte-level: a 4-byte character spans several tokens
    assert plan_jump_forward(emoji_ids[:1], "x", decode, encode) == (0, [])
    assert plan_jump_forward(encode("a"), "", decode, encode) == (0, [])


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "a_fairly_long_field_name": {"type": "string", "maxLength": 8},
            "second_long_field_name": {"type": "integer"},
        },
        "required": ["a_fairly_long_field_name", "second_long_field_name"],
    }
)


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_apply_jump_forward_moves_grammar_and_ids(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    grammar = backends[backend_name].compile("json", SCHEMA)
    assert isinstance(grammar, Grammar)
    assert grammar.jump_forward_string().startswith('{"a_fairly_long_field_name":')
    jump = apply_jump_forward(grammar, [], decode, encode)
    assert jump is not None and jump.num_dropped == 0
    assert decode(jump.new_ids) == jump.forced and jump.new_ids == encode(jump.forced)
    assert grammar.num_accepted_tokens == len(jump.new_ids)
    generator = torch.Generator().manual_seed(7)
    sample = sample_masked(
        grammar, backends[backend_name].tokenizer_info, generator, jump_forward=True
    )
    text = decode(jump.new_ids) + sample.text
    value = json.loads(text)
    assert set(value) == {"a_fairly_long_field_name", "second_long_field_name"}
    assert sample.num_jumps >= 1  # the second key was forced too


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_apply_jump_forward_refused_leaves_grammar_unchanged(
    backends: dict[str, GrammarBackend], backend_name: str
) -> None:
    grammar = backends[backend_name].compile("regex", "abc(d|e)")
    assert isinstance(grammar, Grammar)
    before = grammar.num_accepted_tokens
    # A lying encoder: its ids do not spell the forced text, so the plan must be rejected.
    assert apply_jump_forward(grammar, [], decode, lambda text: encode("zzz")) is None
    assert grammar.num_accepted_tokens == before and grammar.jump_forward_string() == "abc"
