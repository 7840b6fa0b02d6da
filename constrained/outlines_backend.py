"""The outlines backend: outlines-core's token index for masks, interegular for jump-forward.

Workarounds for outlines-core 0.2.x, found by probing it:
- Its index drops every transition out of a final state into a non-final one (after a
  digit of `1(\\.5)?` the `.` is gone; `a*b?a` loses `b`). We index `(?:R)\\x00` instead:
  no state is final before the sentinel NUL, so nothing is dropped, and a state accepts R
  exactly when the sentinel leads to a final state. Tokens containing NUL are never allowed
  (the sentinel is a synthetic id beyond the logits width).
- Its schema-to-regex ignores numeric bounds (minimum/maximum, exclusive*, multipleOf):
  such schemas are refused (`supports` says why), as are keywords a regex cannot enforce.
- Advancing past EOS raises: EOS never reaches outlines-core; we handle it here.
- Its regex engine reads `\\d` and `\\w` as Unicode classes (with a newer Unicode table
  than Python's `re`); we rewrite them to the ASCII classes xgrammar uses, so both backends
  agree and every output also fullmatches under Python's `re`.
- `Vocabulary.from_pretrained` reaches for the network: the vocabulary is built from
  TokenizerInfo (bytes keys, no special tokens, no EOS).
"""

from __future__ import annotations

import json
import threading
from typing import Any, NamedTuple

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from constrained.base import Grammar, InvalidGrammar, TokenizerInfo
from constrained.bitmask import set_token_bits_, token_ids_to_words
from constrained.char_fsm import CharFSM, CharState

_SENTINEL = b"\x00"
# JSON-schema keywords whose constraint outlines-core's regex silently drops.
_REFUSED_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "uniqueItems",
        "contains",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "$ref",
        "allOf",
    }
)


class _Step(NamedTuple):
    index_state: int
    char_state: CharState
    is_eos: bool


class OutlinesCompiled:
    """An outlines-core Index of `(?:R)\\x00` + R's char FSM + per-state masks (lazy)."""

    def __init__(self, index: Any, char_fsm: CharFSM | None, compiler: OutlinesCompiler) -> None:
        self.index = index
        self.char_fsm = char_fsm
        self.compiler = compiler
        self._masks: dict[int, torch.Tensor] = {}
        self._accepting: dict[int, bool] = {}
        self._lock = threading.Lock()

    def is_accepting(self, state: int) -> bool:
        if state not in self._accepting:
            after = self.index.get_next_state(state, self.compiler.sentinel_id)
            self._accepting[state] = after is not None and self.index.is_final_state(after)
        return self._accepting[state]

    def mask_words(self, state: int) -> torch.Tensor:
        words = self._masks.get(state)
        if words is None:
            info = self.compiler.tokenizer_info
            allowed = torch.tensor(self.index.get_allowed_tokens(state), dtype=torch.int64)
            allowed = allowed[allowed < info.vocab_size]
            words = token_ids_to_words(allowed, info.vocab_size) & self.compiler.normal_words
            if self.is_accepting(state):
                set_token_bits_(words, info.eos_token_ids, True)
            with self._lock:
                self._masks[state] = words
        return words


class OutlinesGrammar(Grammar):
    """Walks an OutlinesCompiled index one token at a time, keeping a full state history."""

    def __init__(self, compiled: OutlinesCompiled, history: list[_Step] | None = None) -> None:
        self._compiled = compiled
        fsm = compiled.char_fsm
        start = _Step(compiled.index.get_initial_state(), _char_initial(fsm), False)
        self._history = history if history is not None else [start]

    def accept_token(self, token_id: int) -> bool:
        step = self._history[-1]
        compiler = self._compiled.compiler
        if step.is_eos:
            return False
        if token_id in compiler.tokenizer_info.eos_token_ids:
            if not self._compiled.is_accepting(step.index_state):
                return False
            self._history.append(_Step(step.index_state, step.char_state, True))
            return True
        if token_id in compiler.banned_ids or not 0 <= token_id < len(compiler.vocab):
            return False
        nxt = self._compiled.index.get_next_state(step.index_state, int(token_id))
        if nxt is None:
            return False
        char_state = step.char_state
        if self._compiled.char_fsm is not None:
            char_state = self._compiled.char_fsm.advance(char_state, compiler.vocab[token_id])
        self._history.append(_Step(nxt, char_state, False))
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted_tokens} tokens")
        if num_tokens:
            del self._history[-num_tokens:]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        step = self._history[-1]
        if step.is_eos:
            bitmask[row] = 0
            return
        bitmask[row] = self._compiled.mask_words(step.index_state)

    def is_terminated(self) -> bool:
        return self._history[-1].is_eos

    def jump_forward_string(self) -> str:
        step = self._history[-1]
        if step.is_eos or self._compiled.char_fsm is None:
            return ""
        return self._compiled.char_fsm.forced_string(step.char_state)

    def copy(self) -> OutlinesGrammar:
        return OutlinesGrammar(self._compiled, list(self._history))

    @property
    def num_accepted_tokens(self) -> int:
        return len(self._history) - 1

    @property
    def vocab_size(self) -> int:
        return self._compiled.compiler.tokenizer_info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._compiled.compiler.tokenizer_info.eos_token_ids


class OutlinesCompiler:
    """Builds outlines-core indexes over a Vocabulary made from TokenizerInfo."""

    name = "outlines"

    def __init__(self, tokenizer_info: TokenizerInfo) -> None:
        self.tokenizer_info = tokenizer_info
        self.vocab = tokenizer_info.vocab
        excluded = tokenizer_info.special_token_ids | tokenizer_info.eos_token_ids
        self.banned_ids = excluded | {i for i, t in enumerate(self.vocab) if _SENTINEL in t}
        self.sentinel_id = max(tokenizer_info.vocab_size, len(self.vocab))
        token_map: dict[bytes, list[int]] = {_SENTINEL: [self.sentinel_id]}
        for token_id, token in enumerate(self.vocab):
            if token_id not in self.banned_ids and token:
                token_map.setdefault(token, []).append(token_id)
        eos = min(tokenizer_info.eos_token_ids)
        self._vocabulary = outlines_core.Vocabulary(eos, token_map)
        allowed = [i for i in range(len(self.vocab)) if i not in self.banned_ids]
        self.normal_words = token_ids_to_words(torch.tensor(allowed), tokenizer_info.vocab_size)

    def supports(self, kind: str, spec: str) -> bool | str:
        if kind in ("ebnf", "structural_tag"):
            return f"outlines-core compiles regular languages only (no {kind} grammars)"
        if kind != "json":
            return True
        try:
            schema = json.loads(spec)
        except ValueError:
            return True  # compile reports the parse error
        found = sorted(_keywords_in(schema) & _REFUSED_KEYWORDS)
        if found:
            return f"outlines-core's schema-to-regex does not enforce {', '.join(found)}"
        return True

    def compile(self, kind: str, spec: str) -> OutlinesCompiled | InvalidGrammar:
        if kind == "json":
            try:
                json.loads(spec)
                regex = build_regex_from_schema(spec, whitespace_pattern="")
            except (ValueError, TypeError) as exc:
                return InvalidGrammar(f"invalid json schema for outlines: {exc}")
        elif kind == "regex":
            regex = ascii_shorthand_classes(spec)
        else:
            return InvalidGrammar(f"outlines backend cannot compile {kind!r}")
        try:
            index = outlines_core.Index(f"(?:{regex})\\x00", self._vocabulary)
        except (ValueError, TypeError, RuntimeError) as exc:
            return InvalidGrammar(f"invalid regex for outlines: {exc}")
        return OutlinesCompiled(index, _char_fsm_or_none(regex), self)

    def new_grammar(self, compiled: OutlinesCompiled) -> OutlinesGrammar:
        return OutlinesGrammar(compiled)


_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_shorthand_classes(regex: str) -> str:
    """Rewrite `\\d` / `\\w` (inside or outside brackets) to their ASCII ranges."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped in _ASCII_CLASSES:
                ranges = _ASCII_CLASSES[escaped]
                out.append(ranges if in_class else f"[{ranges}]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            if regex[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":  # a literal ] right after the opening bracket
                out.append("]")
                i += 1
        else:
            in_class = in_class and char != "]"
            out.append(char)
        i += 1
    return "".join(out)


def _char_fsm_or_none(regex: str) -> CharFSM | None:
    """interegular parses most of the regex syntax; without it jump-forward is simply off."""
    try:
        return CharFSM(regex)
    except Exception:  # noqa: BLE001 - interegular raises many types on unsupported syntax
        return None


def _char_initial(fsm: CharFSM | None) -> CharState:
    return fsm.initial if fsm is not None else CharState(None, b"")


def _keywords_in(node: Any) -> set[str]:
    """Every schema keyword used anywhere in a schema (property names are not keywords)."""
    if isinstance(node, list):
        return set().union(*(_keywords_in(v) for v in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = set(node)
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for sub in value.values():
                found |= _keywords_in(sub)
        elif key not in ("enum", "const", "default", "examples"):
            found |= _keywords_in(value)
    return found
