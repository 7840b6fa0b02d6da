"""Build a `Tokenizer` from GGUF tokenizer metadata as llama.cpp reads it: byte-level BPE with
llama.cpp's pre-tokenizers ("gpt2"), SentencePiece BPE ("llama") and Gemma 4's BPE ("gemma4")."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from sglang_like.tokenizer import Tokenizer, chat_stop_token_ids

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (_UNKNOWN, _CONTROL, _UNUSED)

# Pre-tokenizer regexes. llama.cpp (llama-vocab.cpp) applies a list of regexes one after the other,
# each splitting every piece left by the previous ones into its matches and the text between them;
# a Sequence of isolated `Split`s does the same. The patterns are the Hugging Face originals
# (Oniguruma has the Unicode classes and (?i:) that llama.cpp had to rewrite for std::regex).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: combining marks stay with the letters before them.
_QWEN35_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Tekken (Mistral Nemo) and GPT-4o (Llama 4): words split at case changes.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_RE = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_RE = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = r"[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    # DeepSeek lists the cased letters (Lu/Ll/Lt) range by range; \p{LC} is that class.
    r"\s?\p{LC}+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_PORO = (r" ?[^(\s|.,!?…。，、।۔،)]+",)


class _Pre(NamedTuple):
    """How llama.cpp pre-tokenizes one family of BPE vocabs."""

    regexes: tuple[str, ...]
    # A word that is itself a vocab token is taken whole, before any merge (ignore_merges).
    ignore_merges: bool = False
    # llama.cpp adds BOS for these when the GGUF has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False


def _family(names: str, pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre (llama.cpp's names) -> its pre-tokenizer.
_PRE_TYPES: dict[str, _Pre] = {
    **_family("default", _Pre(_DEFAULT)),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
              _Pre((_LLAMA3_RE,), ignore_merges=True, add_bos=True)),
    **_family("dbrx smaug-bpe chatglm-bpe", _Pre((_LLAMA3_RE,))),
    **_family("glm4 glm5", _Pre((_LLAMA3_RE,), ignore_merges=True)),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 hunyuan megrez solar-open grok-2",
              _Pre((_QWEN2_RE,))),
    **_family("qwen35", _Pre((_QWEN35_RE,))),
    # "gpt2" is not a llama.cpp name but reads as GPT-2's regex to anyone who writes it.
    **_family("gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum "
              "modern-bert jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion "
              "granite-docling exaone4", _Pre((_GPT2_RE,))),
    **_family("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
              _Pre((r"\p{N}", _GPT2_RE))),
    **_family("poro-chat bloom gpt3-finnish", _Pre(_PORO)),
    **_family("viking", _Pre((*_PORO, r"\p{N}"))),
    **_family("falcon", _Pre(_FALCON)),
    **_family("deepseek-llm", _Pre(_DEEPSEEK_LLM)),
    **_family("deepseek-coder", _Pre(_DEEPSEEK_CODER)),
    **_family("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _Pre(_DEEPSEEK_V3)),
    **_family("tekken", _Pre((_TEKKEN_RE,), ignore_merges=True, add_bos=True)),
    **_family("gpt-4o llama4 kanana2 talkie minimax-m2", _Pre((_GPT4O_RE,))),
}


def _pre_type(pre: str | None) -> _Pre:
    if pre is None:
        # As llama.cpp: a BPE vocab without a pre-tokenizer name gets the default regexes.
        logger.warning("GGUF has no tokenizer.ggml.pre: using llama.cpp's default pre-tokenizer")
        return _PRE_TYPES["default"]
    if pre not in _PRE_TYPES:
        raise ValueError(
            f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not implemented "
            f"(known: {', '.join(sorted(_PRE_TYPES))})"
        )
    return _PRE_TYPES[pre]


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer equivalent to llama.cpp's regexes for `tokenizer.ggml.pre`."""
    return _byte_level_pre_tokenizer(_pre_type(pre))


def _byte_level_pre_tokenizer(pre: _Pre) -> pre_tokenizers.PreTokenizer:
    splits = [_split(r) for r in pre.regexes]
    raw_byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, raw_byte_level])


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    # llama.cpp cuts each "left right" entry at the first space after the first character.
    out = []
    for merge in metadata.get("tokenizer.ggml.merges") or []:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(f"GGUF merge {merge!r} has no separating space")
        out.append((merge[:cut], merge[cut + 1:]))
    return out


def _byte_level_backend(metadata: dict[str, Any], vocab: dict[str, int]) -> Backend:
    pre = _pre_type(metadata.get("tokenizer.ggml.pre"))
    backend = Backend(models.BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=False,
                                 byte_fallback=False, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
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


def _gemma4_backend(metadata: dict[str, Any], vocab: dict[str, int]) -> Backend:
    """llama.cpp's "gemma4" vocab: SentencePiece-style BPE over raw UTF-8 (spaces written as
    U+2581, <0xXX> byte tokens for what no merge covers), split only at newline runs."""
    backend = Backend(models.BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=False,
                                 byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = _split(r"[^\n]+|\n+")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


# Tokenizer models llama.cpp knows that this module does not build, by what they are.
_UNSUPPORTED_KINDS = {
    "bert": "WordPiece (BERT)", "t5": "Unigram (T5)", "rwkv": "RWKV greedy",
    "plamo2": "PLaMo-2 Aho-Corasick", "no_vocab": "no vocabulary",
}


def _adds_bos_eos(metadata: dict[str, Any], kind: str) -> tuple[bool, bool]:
    """Whether llama.cpp adds BOS / EOS with add_special: the GGUF's flags, else its defaults
    (SentencePiece and a few BPE pre-tokenizers add BOS); Gemma 4 always gets BOS."""
    if kind == "llama":
        default_bos = True
    elif kind == "gemma4":
        return True, bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    else:
        pre = metadata.get("tokenizer.ggml.pre")
        default_bos = pre in _PRE_TYPES and _PRE_TYPES[pre].add_bos
    return (bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
            bool(metadata.get("tokenizer.ggml.add_eos_token", False)))


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
    elif kind == "gemma4":
        backend = _gemma4_backend(metadata, vocab)
    else:
        what = f" ({_UNSUPPORTED_KINDS[kind]})" if kind in _UNSUPPORTED_KINDS else ""
        raise ValueError(
            f"GGUF tokenizer model tokenizer.ggml.model={kind!r}{what} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE, 'gemma4')"
        )
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    pairs = list(zip(tokens, types, strict=True))
    # Phi-3 GGUFs: llama.cpp (like Phi-3's own tokenizer) strips the whitespace after its
    # special tokens, e.g. the "\n" the chat template writes after <|end|>.
    name = str(metadata.get("general.name", "")).lower()
    rstrip: set[str] = set()
    if "phi-3" in name or "phi3" in name:
        rstrip = {t for t, ty in pairs if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)}
        rstrip -= {"<unk>", "<s>", "<|endoftext|>"}
    specials = [t for t, ty in pairs if ty in _SPECIAL_TYPES]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, rstrip=t in rstrip) for t in specials]
    )
    user_defined = [t for t, ty in pairs if ty == _USER_DEFINED]
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False, rstrip=t in rstrip) for t in user_defined]
    )

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos, add_eos = _adds_bos_eos(metadata, kind)
    head = [tokens[bos_id]] if add_bos and bos_id is not None else []
    tail = [tokens[eos_id]] if add_eos and eos_id is not None else []
    if head or tail:
        # add_special_tokens=True: BOS before and/or EOS after the text, as llama.cpp adds them.
        backend.post_processor = processors.TemplateProcessing(
            single=[*head, "$A", *tail], pair=[*head, "$A", "$B", *tail],
            special_tokens=[(t, vocab[t]) for t in {*head, *tail}],
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
