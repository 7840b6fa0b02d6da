"""Tokenizer: GGUF-built byte-level BPE vs transformers, digits, specials, bytes, chat template."""

from __future__ import annotations

import os
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models
from tokenizers import pre_tokenizers as pt

from sglang_like.model_loader import default_model_path, load_tokenizer
from sglang_like.model_loader.gguf_tokenizer import build_pre_tokenizer
from sglang_like.tokenizer import Tokenizer

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\r\n mixed",
    "I'm sure you'll see they've done it; we'd go, he's here.",
    "Numbers: 3.14159, 2024-06-01, 1,000,000 and x=42",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Ünïcödé çàfé naïve résumé",
    "中文字符测试，日本語のテキスト、한국어 문장",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "Русский текст и ελληνικά",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|endoftext|>specials<repo_name>here",
    "",
    "    ",
    "a 1 b  22 c   333",
    "Arabic digits ٣٤ ١ and fractions ½ ⅔ ²",
]
_POOL = list("abcXYZ019 \t\n.,!?'\"-_()[]{}") + list("éüñçß中文日本😀🎉👍") + [" 12", "  7"]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' own GGUF tokenizer, with its pre-tokenizer fixed to smollm's digit split."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path())
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf.backend_tokenizer.pre_tokenizer = pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    return hf


@pytest.mark.parametrize("text", CORPUS + _random_texts(200))
def test_ids_match_transformers_with_digit_split(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS + _random_texts(100, seed=1))
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", ["12345", "a 1 b", "x  345", "3.14159", "year 2024!", "v1.2.3"])
def test_every_digit_is_its_own_token(tok: Tokenizer, text: str) -> None:
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert "".join(pieces) == text
    for piece in pieces:
        if any(c.isdigit() for c in piece):
            assert len(piece) == 1, pieces


def test_plain_gpt2_regex_differs_on_space_before_digits(tok: Tokenizer, hf_tok) -> None:
    # The difference docs/architecture.md documents: transformers' GGUF conversion uses the
    # plain GPT-2 regex, under which "  7" keeps the space with the digit.
    plain = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    plain.pre_tokenizer = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    text = "value  7 and 12"
    assert plain.encode(text, add_special_tokens=False).ids != tok.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


def test_special_tokens_in_text_are_parsed(tok: Tokenizer) -> None:
    im_start = tok.token_to_id("<|im_start|>")
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == im_start
    assert im_start in tok.special_token_ids
    assert tok.decode(ids, skip_special_tokens=True) == "user"


def test_no_bos_added_and_stop_ids(tok: Tokenizer, hf_tok) -> None:
    assert tok.encode("hi", add_special_tokens=True) == hf_tok.encode("hi")
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids  # the ChatML turn end
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.vocab_size == len(hf_tok)
    assert len(tok.special_token_ids) == 17


def test_token_bytes_list(tok: Tokenizer) -> None:
    table = tok.token_bytes_list()
    assert len(table) == tok.vocab_size
    for text in CORPUS[:12] + _random_texts(50, seed=2):
        assert b"".join(table[i] for i in tok.encode(text)) == text.encode("utf-8")
    for i in tok.special_token_ids:
        assert table[i] == tok.id_to_token(i).encode()
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|im_start|>"]


CONVERSATIONS = [
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_chat_template_errors_and_missing() -> None:
    backend = Backend(models.BPE(vocab={"a": 0}, merges=[]))
    failing = Tokenizer(backend, chat_template="{{ raise_exception('bad role') }}")
    with pytest.raises(ValueError, match="bad role"):
        failing.apply_chat_template([{"role": "x", "content": "y"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template([])


def test_hf_folder_tokenizer_matches(tok: Tokenizer, hf_tok, tmp_path) -> None:
    hf_tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[0]) == tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.token_to_id("<|im_end|>") in loaded.eos_token_ids
    assert loaded.special_token_ids == tok.special_token_ids


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("smollm", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("llama-bpe", "ab 12345", ["ab", "Ġ", "123", "45"]),
        ("gpt2", "ab 12345", ["ab", "Ġ12345"]),
    ],
)
def test_pre_tokenizers(pre: str, text: str, pieces: list[str]) -> None:
    assert [p for p, _ in build_pre_tokenizer(pre).pre_tokenize_str(text)] == pieces


def test_metaspace_token_bytes() -> None:
    vocab = {"<0x0A>": 0, "\u2581hi": 1, "a": 2}
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    assert Tokenizer(backend).token_bytes_list() == [b"\n", b" hi", b"a"]


def _spm_metadata() -> dict:
    pieces = ["\u2581", "h", "e", "l", "o", "he", "ll", "\u2581he", "llo", "\u2581hello", "w"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(10 - len(p)) for p in pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_gguf_sentencepiece_vocab() -> None:
    from sglang_like.model_loader.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(_spm_metadata())
    ids = tok.encode("hello hé", add_special_tokens=True)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["<s>", "\u2581hello", "\u2581", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello hé"
    table = tok.token_bytes_list()
    assert b"".join(table[i] for i in ids[1:]) == " hello hé".encode()
    assert tok.eos_token_ids == {2} and tok.special_token_ids == {0, 1, 2}
