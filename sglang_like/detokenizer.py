"""Streaming detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from collections.abc import Sequence

from sglang_like.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of context decoded before the first new token (so e.g. a SentencePiece leading-space
# token after a prompt decodes as it would inside the full text).
_MAX_PREFIX_CONTEXT = 6
# A character spans at most 4 bytes, so a window still ending in U+FFFD after this many pending
# tokens is invalid UTF-8 from the model, not a partial character: emit it, keeping calls O(1).
_MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, O(new tokens) per call.

    Keeps two offsets into the ids (after vLLM/TGI): `prefix` marks where the decode window
    starts, `read` the first id whose text was not emitted. Each call decodes only
    ids[prefix:] and ids[prefix:read] and emits the difference, holding back while the window
    ends in an incomplete character (decodes to U+FFFD). Windows stay a few tokens long.

        ids:  ... | prefix ........ read ........ end |
                    already emitted   not yet emitted
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_MAX_PREFIX_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose text is held back (waiting for the rest of a character)."""
        return len(self._ids) - self._read_offset

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return the text they completed ("" while a character is partial)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        is_partial = new_text.endswith(_REPLACEMENT)
        if len(new_text) <= len(prefix_text) or (
            is_partial and self.num_pending_tokens <= _MAX_PENDING_TOKENS
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        self._trim()
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD, as in decode)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def _trim(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them so memory stays O(window).
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
