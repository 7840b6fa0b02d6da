"""GGUF tokenizers against llama.cpp's own tokenizer test vectors.

llama.cpp ships vocab-only GGUFs (models/ggml-vocab-<name>.gguf) with inputs (.gguf.inp, separated
by "\\n__ggml_vocab_test__\\n") and the ids its tokenizer must give (.gguf.out, one line of
space-separated ids per input). tests/test-tokenizer-0.cpp reads them this way and tokenizes
with add_special=False (no BOS), parse_special=False; llama-spm is also held to
tests/test-tokenizer-1-spm.cpp (every token and code point survives decode -> encode -> decode).
"""

from __future__ import annotations

import functools

import pytest

from sglang_like.model_loader.gguf_file import read_gguf
from sglang_like.model_loader.gguf_tokenizer import build_pre_tokenizer, tokenizer_from_gguf
from sglang_like.tokenizer import Tokenizer

from ..llama_cpp_source import llama_cpp_tree

# name -> (tokenizer.ggml.model, tokenizer.ggml.pre): the vocabs with vectors of the families we
# serve or could; the kind/pre pair is asserted so a re-vendored file cannot change it unseen.
VOCABS = {
    "llama-spm": ("llama", "default"),
    "phi-3": ("llama", "default"),
    "llama-bpe": ("gpt2", "llama-bpe"),
    "qwen2": ("gpt2", "qwen2"),
    "qwen35": ("gpt2", "qwen35"),
    "gemma-4": ("gemma4", None),
    "gpt-2": ("gpt2", "gpt-2"),
    "starcoder": ("gpt2", "starcoder"),
    "refact": ("gpt2", "refact"),
    "deepseek-llm": ("gpt2", "deepseek-llm"),
    "deepseek-coder": ("gpt2", "deepseek-coder"),
    "falcon": ("gpt2", "falcon"),
    "mpt": ("gpt2", "mpt"),
    "command-r": ("gpt2", "command-r"),
}
_SEP = "\n__ggml_vocab_test__\n"
_CONTROL, _UNKNOWN = 3, 2


def _vocab_path(name: str) -> str:
    return str(llama_cpp_tree() / "models" / f"ggml-vocab-{name}.gguf")


@functools.cache
def _metadata(name: str) -> dict:
    return read_gguf(_vocab_path(name)).metadata


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return tokenizer_from_gguf(_metadata(name))


def _vectors(name: str) -> list[tuple[str, list[int]]]:
    """(input, expected ids) pairs, split exactly as test-tokenizer-0.cpp's read_tests does."""
    path = _vocab_path(name)
    with open(path + ".inp", encoding="utf-8", newline="") as f:
        raw = f.read()
    inputs, pos = [], 0
    while pos < len(raw):  # a trailing separator ends the last input; it opens no empty one
        nxt = raw.find(_SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(_SEP)
    with open(path + ".out", encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":  # getline yields no line after the final newline
        lines.pop()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs, {len(lines)} outputs"
    assert len(inputs) >= 40
    return [(s, [int(t) for t in line.split()]) for s, line in zip(inputs, lines, strict=True)]


def test_vocab_set_is_what_llama_cpp_ships() -> None:
    # Every vocab llama.cpp gives vectors for is either tested here or refused (bert-bge).
    shipped = {p.name[len("ggml-vocab-"):-len(".gguf.inp")]
               for p in (llama_cpp_tree() / "models").glob("ggml-vocab-*.gguf.inp")}
    assert shipped == set(VOCABS) | {"bert-bge"}


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_llama_cpp_vectors(name: str) -> None:
    meta = _metadata(name)
    assert (meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre")) == VOCABS[name]
    tok = _tokenizer(name)
    vectors = _vectors(name)
    # llama.cpp tokenizes without parsing special tokens; ours always parses them. No input holds
    # a control/unknown token's text, so both read the same text the same way.
    types = meta["tokenizer.ggml.token_type"]
    controls = [t for t, ty in zip(meta["tokenizer.ggml.tokens"], types, strict=True)
                if ty in (_CONTROL, _UNKNOWN)]
    assert not [(s, c) for s, _ in vectors for c in controls if c in s]
    failures = [(text, got, want) for text, want in vectors
                if (got := tok.encode(text, add_special_tokens=False)) != want]
    assert not failures, f"{len(failures)}/{len(vectors)} differ, first: {failures[:3]}"
    # Lossless: every input decodes back to itself (byte-level / byte-fallback vocabs).
    assert [text for text, want in vectors if tok.decode(want) != text] == []


def test_llama_spm_token_and_codepoint_roundtrip() -> None:
    """test-tokenizer-1-spm: detokenize each token (specials as text), tokenize that with special
    parsing, detokenize again: the same text; likewise each code point on its own (U+2581, the
    space marker itself, excepted). Code points: all below U+3000 and a stride of the rest
    (llama.cpp walks them all; the stride keeps this test to about a second)."""
    tok = _tokenizer("llama-spm")
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    again = [tok.decode(ids) for ids in tok.encode_batch(texts)]
    assert [(i, t, a) for i, (t, a) in enumerate(zip(texts, again, strict=True)) if t != a] == []
    points = [c for c in [*range(0x3000), *range(0x3000, 0x110000, 11)]
              if not (0xD800 <= c <= 0xDFFF or 0x40000 <= c <= 0xE0000) and c != 0x2581]
    chars = [chr(c) for c in points]
    back = tok.backend.decode_batch(tok.encode_batch(chars))
    assert [hex(ord(c)) for c, b in zip(chars, back, strict=True) if c != b] == []


@pytest.mark.parametrize(
    ("name", "bos"),
    [("llama-spm", 1), ("phi-3", 1), ("llama-bpe", 128000), ("gemma-4", 2),
     ("deepseek-llm", 100000), ("command-r", 5), ("gpt-2", None), ("qwen2", None),
     ("starcoder", None)],
)
def test_bos_as_llama_cpp_adds_it(name: str, bos: int | None) -> None:
    # llama.cpp: the GGUF's add_bos_token (set in llama-spm, phi-3, gemma-4, deepseek-llm,
    # command-r), else on for SentencePiece and llama3-style BPE (the llama-bpe file has no
    # flag) and off for other BPE vocabs.
    tok = _tokenizer(name)
    plain = tok.encode("Hello world")
    with_specials = tok.encode("Hello world", add_special_tokens=True)
    assert with_specials == ([bos] if bos is not None else []) + plain


def test_gemma4_newline_runs_are_single_tokens() -> None:
    # llama.cpp takes a newline-only piece whole when the vocab has it (Gemma 4 lists runs of
    # "\n"); the merges must lead to the same token between other text.
    tok = _tokenizer("gemma-4")
    for n in range(1, 40):
        whole = tok.token_to_id("\n" * n)
        if whole is None:
            continue
        ids = tok.encode("a" + "\n" * n + "b")
        assert ids == [tok.token_to_id("a"), whole, tok.token_to_id("b")], n


def test_phi3_special_tokens_strip_whitespace_after_them() -> None:
    # llama.cpp marks Phi-3's special tokens (not <unk>, <s>, <|endoftext|>) rstrip: the "\n" the
    # chat template writes after <|user|> / <|end|> is not tokenized; the text after a special
    # token gets the SentencePiece space prefix as at the start of a text.
    tok = _tokenizer("phi-3")
    ids = tok.encode("<|user|>\nHi<|end|>\n<|assistant|>")
    user, end, assistant = (tok.token_to_id(t) for t in ("<|user|>", "<|end|>", "<|assistant|>"))
    assert ids == [user, *tok.encode("Hi"), end, assistant]
    # <|endoftext|> keeps what follows
    assert tok.encode("<|endoftext|>\nHi")[1:] == tok.encode("\nHi")


def test_wordpiece_vocab_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'bert'.*WordPiece"):
        tokenizer_from_gguf(read_gguf(_vocab_path("bert-bge")).metadata)


def test_unknown_pre_tokenizer_is_refused_by_name() -> None:
    # kimi-k2's pre-tokenizer is custom code in llama.cpp, not a regex list: not implemented.
    meta = {**_metadata("gpt-2"), "tokenizer.ggml.pre": "kimi-k2"}
    with pytest.raises(ValueError, match="kimi-k2"):
        tokenizer_from_gguf(meta)
    with pytest.raises(ValueError, match="'rwkv'"):
        tokenizer_from_gguf({**_metadata("gpt-2"), "tokenizer.ggml.model": "rwkv"})


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        # case changes split words; digits one by one; contractions apart from the word
        ("tekken", ["Hello", "World", "ĠI", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok", "?ĊĊ",
                    "Ġä¸Ńæĸĩx"]),
        # contractions stay on the word; digits in threes
        ("gpt-4o", ["Hello", "World", "ĠI'm", "Ġ", "123", "45", "Ġok", "?ĊĊ", "Ġä¸Ńæĸĩx"]),
        # digits and CJK split out first; punctuation takes the ASCII letters after it
        ("deepseek-v3", ["HelloWorld", "ĠI", "'m", "Ġ", "123", "45", "Ġok", "?ĊĊ", "Ġ", "ä¸Ńæĸĩ",
                         "x"]),
    ],
)
def test_pre_tokenizers_without_vectors(pre: str, pieces: list[str]) -> None:
    # Families whose llama.cpp regexes have no vocab file here, checked against splits worked
    # out by hand from their regexes.
    text = "HelloWorld I'm 12345 ok?\n\n 中文x"
    assert [p for p, _ in build_pre_tokenizer(pre).pre_tokenize_str(text)] == pieces
