"""Build a `Tokenizer` from GGUF tokenizer metadata (byte-level BPE, llama.cpp pre-tokenizers)."""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from sglang_like.tokenizer import Tokenizer, chat_stop_token_ids

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (_UNKNOWN, _CONTROL, _UNUSED)

_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values (llama.cpp's names) grouped by the splitting they need.
_GPT2_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2 = {"gpt2", "default", "gpt-2", "olmo", "phi-2", "jais", "mpt", "poro-chat", "bloom"}
_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"}


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer equivalent to llama.cpp's regexes for `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw_byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _GPT2_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3:
        return pre_tokenizers.Sequence([_split(_LLAMA3_RE), raw_byte_level])
    if pre in _QWEN2:
        return pre_tokenizers.Sequence([_split(_QWEN2_RE), raw_byte_level])
    if pre is not None and pre not in _GPT2:
        logger.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 regex", pre)
    return byte_level


def _byte_level_backend(metadata: dict[str, Any], vocab: dict[str, int]) -> Backend:
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = build_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    # SentencePiece BPE merges the adjacent pair whose union has the best score; as BPE ranks:
    # every split of every token into two vocab pieces, ordered by the token's score.
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_backend(metadata: dict[str, Any], vocab: dict[str, int], tokens: list[str]) -> Backend:
    """llama.cpp's "llama" (SentencePiece BPE) vocab: score-ranked merges, byte fallback."""
    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = Backend(
        models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores), unk_token=unk,
                   fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """A `Tokenizer` from the tokenizer.ggml.* / tokenizer.chat_template fields of a GGUF file."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        backend = _byte_level_backend(metadata, vocab)
    elif kind == "llama":
        backend = _spm_backend(metadata, vocab, tokens)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} unsupported (want 'gpt2' or 'llama')")
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    pairs = list(zip(tokens, types, strict=True))
    specials = [t for t, ty in pairs if ty in _SPECIAL_TYPES]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user_defined = [t for t, ty in pairs if ty == _USER_DEFINED]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS by default for SentencePiece vocabs, not for byte-level BPE ones.
    if metadata.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos_id is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
            special_tokens=[(tokens[bos_id], bos_id)],
        )

    template = metadata.get("tokenizer.chat_template")
    stop_ids = chat_stop_token_ids(template, vocab)
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if (value := metadata.get(f"tokenizer.ggml.{key}")) is not None:
            stop_ids.add(int(value))
    names = {"bos_token": bos_id, "eos_token": eos_id,
             "unk_token": metadata.get("tokenizer.ggml.unknown_token_id"),
             "pad_token": metadata.get("tokenizer.ggml.padding_token_id")}
    return Tokenizer(
        backend,
        eos_token_ids=stop_ids,
        bos_token_id=None if bos_id is None else int(bos_id),
        chat_template=template,
        special_tokens_map={k: tokens[v] for k, v in names.items() if v is not None},
    )


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads metadata, skips the tensors; no torch)."""
    from sglang_like.model_loader.gguf_file import read_gguf

    return tokenizer_from_gguf(read_gguf(path).metadata)
