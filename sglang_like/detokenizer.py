"""Streaming detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from sglang_like.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of prompt context the window path decodes before the first new token (so e.g. a
# SentencePiece leading-space token after a prompt decodes as it would inside the full text).
_MAX_PREFIX_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, O(new tokens) per call.

    Byte-level tokenizers (GPT-2 style BPE: SmolLM2, Llama 3, Qwen2/3) take the exact path:
    each token's raw bytes go through an incremental UTF-8 decoder, which holds back at most
    the 3 bytes of an unfinished character; this is what the full decode does, so the deltas
    concatenate to `tokenizer.decode(all ids)`.

    Other tokenizers (SentencePiece-style) use a decode window (after vLLM/TGI): `prefix`
    marks where the window starts, `read` the first id not yet folded into it. Each call
    decodes ids[prefix:read] and ids[prefix:], and emits the new text up to any trailing
    U+FFFD (an unfinished character); offsets move once the window ends cleanly.

        ids:  ... | prefix ........ read ........ end |
                    decoded context   new tokens
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._chunks: list[str] = []
        self._is_byte_level = bool(getattr(tokenizer, "is_byte_level", False))
        if self._is_byte_level:
            self._token_bytes = tokenizer.token_bytes
            skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
            self._skipped_ids = skipped
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = list(prompt_ids[-_MAX_PREFIX_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_emitted_past_read = 0  # chars of ids[read:]'s text already emitted

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return the text they completed ("" while a character is partial)."""
        if self._is_byte_level:
            delta = self._utf8.decode(self._bytes_of(token_ids))
        else:
            self._ids.extend(token_ids)
            delta = self._window_delta(final=False)
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD, as in decode)."""
        if self._is_byte_level:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._window_delta(final=True)
        if delta:
            self._chunks.append(delta)
        return delta

    def _bytes_of(self, token_ids: Sequence[int]) -> bytes:
        table, skipped, n = self._token_bytes, self._skipped_ids, len(self._token_bytes)
        # Ids past the tokenizer's vocab (padded embedding rows) decode to nothing, as in decode.
        return b"".join(table[i] for i in token_ids if i not in skipped and 0 <= i < n)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _window_delta(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
        is_clean = final or not new_text.endswith(_REPLACEMENT)
        safe_text = new_text if is_clean else new_text.rstrip(_REPLACEMENT)
        delta = safe_text[self._num_emitted_past_read :]
        self._num_emitted_past_read += len(delta)
        if is_clean and len(self._ids) > self._read_offset:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_emitted_past_read = 0
            self._trim()
        return delta

    def _trim(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them so memory stays O(window).
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
