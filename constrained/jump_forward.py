"""Jump-forward: append the string a grammar forces, retokenized across the boundary."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from constrained.base import Grammar

_REPLACEMENT = "\ufffd"


class JumpForward(NamedTuple):
    """Drop the last `num_dropped` output tokens, then append `new_ids`."""

    num_dropped: int
    new_ids: list[int]
    forced: str


def plan_jump_forward(
    output_ids: list[int],
    forced: str,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
    max_back_tokens: int = 2,
) -> tuple[int, list[int]]:
    """Plan how to append `forced` to `output_ids` with the tokenizer's own tokenization.

    Returns (k, new_ids) such that decode(output_ids[:-k] + new_ids) == decode(output_ids) +
    forced, where new_ids == encode(text of the dropped tokens + forced): the last k tokens
    (k <= max_back_tokens) are re-encoded together with the forced text so tokens that merge
    across the boundary come out canonical. The largest k that keeps the text exact wins
    (tokens shared at the start of the old and new tails are then kept, not re-sent).
    Returns (0, []) when no exact plan exists (e.g. the output ends inside a UTF-8 sequence).
    """
    if not forced:
        return 0, []
    text = decode(output_ids)
    if text.endswith(_REPLACEMENT):
        return 0, []  # a partial character: forced text could not join it exactly
    target = text + forced
    for k in range(min(max_back_tokens, len(output_ids)), -1, -1):
        kept = output_ids[: len(output_ids) - k]
        kept_text = decode(kept)
        if not text.startswith(kept_text) or kept_text.endswith(_REPLACEMENT):
            continue
        new_ids = encode(target[len(kept_text) :])
        if decode(kept + new_ids) != target:
            continue
        dropped = output_ids[len(kept) :]
        shared = _common_prefix_len(dropped, new_ids)
        return k - shared, new_ids[shared:]
    return 0, []


def apply_jump_forward(
    grammar: Grammar,
    output_ids: list[int],
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
    max_back_tokens: int = 2,
) -> JumpForward | None:
    """Plan a jump-forward for `grammar` and move it there; None (grammar unchanged) if none.

    The grammar is rolled back by k and fed `new_ids` token by token, so its token history
    matches the new output ids (rollback stays exact for speculative decoding). If the
    grammar refuses any of the new tokens, it is restored and None is returned.
    `output_ids` must be exactly the tokens this grammar has accepted.
    """
    forced = grammar.jump_forward_string()
    if not forced:
        return None
    k, new_ids = plan_jump_forward(output_ids, forced, decode, encode, max_back_tokens)
    if not new_ids or k > grammar.num_accepted_tokens:
        return None
    dropped = output_ids[len(output_ids) - k :]
    grammar.rollback(k)
    if grammar.accept_tokens(new_ids):
        return JumpForward(k, new_ids, forced)
    restored = grammar.accept_tokens(dropped)
    assert restored, "re-accepting tokens the grammar accepted before must succeed"
    return None


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
