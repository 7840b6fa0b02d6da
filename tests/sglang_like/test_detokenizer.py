"""IncrementalDetokenizer: deltas concatenate to the full decode, never split a character."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sglang_like.detokenizer import IncrementalDetokenizer
from sglang_like.model_loader import load_tokenizer
from sglang_like.tokenizer import Tokenizer

_POOL = list("abc XYZ 019 \n\t.,!?") + list("éüñçßøå中文日本語한국어ελληνικάрусский") + [
    "😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🦀", "𝔘", "ﷺ", "<|im_end|>", "<|im_start|>",
]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 30))) for _ in range(n)]


class _WindowOnly:
    """The real tokenizer seen as non-byte-level, forcing the detokenizer's decode-window path."""

    is_byte_level = False

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.num_decoded_ids: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.num_decoded_ids.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def real_tok() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(params=["bytes", "window"])
def tok(request, real_tok: Tokenizer):
    """The real tokenizer, once per detokenizer path (tests decode with the real one)."""
    return real_tok if request.param == "bytes" else _WindowOnly(real_tok)


def _full(tok, ids: Sequence[int], skip: bool = True) -> str:
    return getattr(tok, "inner", tok).decode(ids, skip_special_tokens=skip)


def _encode(tok, text: str) -> list[int]:
    return getattr(tok, "inner", tok).encode(text)


def _stream(tok, ids: Sequence[int], skip: bool, chunks: Sequence[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", _random_texts(60, seed=0))
def test_one_token_at_a_time_matches_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = _encode(tok, text)
    deltas = _stream(tok, ids, skip, [1] * len(ids))
    full = _full(tok, ids, skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(10))
def test_random_chunks_match_decode(tok, seed: int) -> None:
    rng = random.Random(seed)
    ids = _encode(tok, "".join(_random_texts(5, seed=100 + seed)))
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(0, 4)))
        left -= chunks[-1]
    deltas = _stream(tok, ids, True, chunks)
    assert "".join(deltas) == _full(tok, ids)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_skipped_special_inside_a_character(tok, skip: bool) -> None:
    # A skipped special token between two characters' byte tokens must not break either.
    ids = _encode(tok, "ι本<|im_start|>어🦀")
    deltas = _stream(tok, ids, skip, [2, 3, 1, 4, len(ids)])
    assert "".join(deltas) == _full(tok, ids, skip)


def test_multibyte_character_is_held_back(tok) -> None:
    ids = _encode(tok, "🦀")  # a rare emoji: several byte tokens, none a whole character
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦀"]


def test_flush_emits_unfinished_bytes_like_decode(tok) -> None:
    ids = _encode(tok, "ok 🦀")[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == _full(tok, ids)
    assert detok.flush() == ""


def test_prompt_context_is_not_emitted(tok) -> None:
    prompt = _encode(tok, "<|im_start|>assistant\n")
    out = _encode(tok, " Hello there!")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.add([i]) for i in out) + detok.flush() == " Hello there!"


def test_window_work_per_call_does_not_grow(real_tok: Tokenizer) -> None:
    ids = real_tok.encode("".join(_random_texts(40, seed=7)) * 5)
    assert len(ids) > 1000
    window = _WindowOnly(real_tok)
    detok = IncrementalDetokenizer(window)  # type: ignore[arg-type]
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == real_tok.decode(ids, skip_special_tokens=True)
    assert max(window.num_decoded_ids) <= 12


def test_byte_path_does_not_decode(real_tok: Tokenizer) -> None:
    class NoDecode(Tokenizer):
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            raise AssertionError("the byte path must not call decode")

    fake = NoDecode(real_tok.backend)
    ids = real_tok.encode("héllo 🦀 world")
    detok = IncrementalDetokenizer(fake)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "héllo 🦀 world"
