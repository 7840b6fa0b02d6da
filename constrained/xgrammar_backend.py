"""The xgrammar backend: compiled grammars from xgrammar, matchers wrapped as Grammar."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from constrained.base import Grammar, InvalidGrammar, TokenizerInfo
from constrained.bitmask import set_token_bits_, token_ids_to_words

# Separators are fixed (no free whitespace) so that keys and punctuation between fields are
# forced, which is what jump-forward needs; the default (", ", ": ") reads naturally.
_JSON_KWARGS = {"any_whitespace": False}


class XGrammarGrammar(Grammar):
    """One xgrammar `GrammarMatcher` plus a mask of the tokens that may ever appear."""

    def __init__(self, matcher: xgr.GrammarMatcher, compiler: XGrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = compiler
        self._num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated() or token_id in self._compiler.special_token_ids:
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_accepted} tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row] = 0  # xgrammar raises here; nothing may follow EOS
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        # Specials whose text the grammar could match must still never be generated.
        bitmask[row] &= self._compiler.ever_allowed_words

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def jump_forward_string(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()

    def copy(self) -> XGrammarGrammar:
        clone = XGrammarGrammar(self._matcher.fork(), self._compiler)
        clone._num_accepted = self._num_accepted
        return clone

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted

    @property
    def vocab_size(self) -> int:
        return self._compiler.tokenizer_info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._compiler.tokenizer_info.eos_token_ids


class XGrammarCompiler:
    """Compiles specs with one shared `xgr.GrammarCompiler`; thread-safe."""

    name = "xgrammar"

    def __init__(self, tokenizer_info: TokenizerInfo, num_threads: int = 2) -> None:
        self.tokenizer_info = tokenizer_info
        self.special_token_ids = tokenizer_info.special_token_ids - tokenizer_info.eos_token_ids
        # Special tokens get empty text, which xgrammar never allows; EOS goes in by id.
        encoded = [
            b"" if i in tokenizer_info.special_token_ids else tok
            for i, tok in enumerate(tokenizer_info.vocab)
        ]
        xgr_info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.RAW,
            vocab_size=tokenizer_info.vocab_size,
            stop_token_ids=sorted(tokenizer_info.eos_token_ids),
        )
        self._compiler = xgr.GrammarCompiler(xgr_info, max_threads=num_threads)
        allowed = tokenizer_info.normal_token_ids
        words = token_ids_to_words(torch.tensor(allowed), tokenizer_info.vocab_size)
        set_token_bits_(words, tokenizer_info.eos_token_ids, True)
        self.ever_allowed_words = words

    def supports(self, kind: str, spec: str) -> bool | str:
        """xgrammar handles every kind; whether a spec compiles is known only by compiling."""
        return True

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar | InvalidGrammar:
        try:
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "ebnf":
                return self._compiler.compile_grammar(spec)
            if kind == "json":
                json.loads(spec)
                return self._compiler.compile_json_schema(spec, **_JSON_KWARGS)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            return InvalidGrammar(f"invalid {kind} for xgrammar: {_first_line(exc)}")
        return InvalidGrammar(f"unknown grammar kind {kind!r}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(xgr.GrammarMatcher(compiled), self)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message.
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__
