"""The grammar contract: plain tokenizer data in, one mutable Grammar per request out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

# structural_tag: xgrammar's structural tag (a JSON string): free text with tagged, schema-
# constrained regions, e.g. tool calls; only the xgrammar backend compiles it.
GrammarKind = Literal["regex", "json", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[str, ...] = ("regex", "json", "ebnf", "structural_tag")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the grammar layer needs to know about the tokenizer, as plain data.

    `vocab[i]` is the raw bytes token i decodes to (special tokens: their text).
    `vocab_size` is the logits width, which may exceed `len(vocab)` (padding rows are
    never allowed). Special tokens are never allowed inside generated text; EOS tokens are
    allowed only where the grammar accepts.
    """

    vocab: list[bytes]
    vocab_size: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def __post_init__(self) -> None:
        if self.vocab_size < len(self.vocab):
            raise ValueError(f"vocab_size {self.vocab_size} < len(vocab) {len(self.vocab)}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        ids = self.eos_token_ids | self.special_token_ids
        bad = [t for t in ids if not 0 <= t < len(self.vocab)]
        if bad:
            raise ValueError(f"special/eos token ids out of range: {sorted(bad)}")

    @property
    def normal_token_ids(self) -> list[int]:
        """Ids of the tokens that may appear inside generated text."""
        excluded = self.special_token_ids | self.eos_token_ids
        return [i for i in range(len(self.vocab)) if i not in excluded]


class InvalidGrammar(NamedTuple):
    """A failed compile (bad spec, unsupported feature, timeout): a value, not an exception."""

    message: str


class Grammar(ABC):
    """The constraint state of one request.

    Owned and mutated only by the scheduler thread. Token-level history is kept so that
    `rollback(k)` undoes the last k accepted tokens (speculative decoding, jump-forward).
    Once EOS is accepted the grammar is terminated and accepts nothing more.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; return False and leave the state unchanged if not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (EOS included)."""

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token set into `bitmask[row]` (int32, 32 tokens per word)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once EOS was accepted (the request is finished by its grammar)."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The text every valid continuation must start with from here ("" if none)."""

    @abstractmethod
    def copy(self) -> Grammar:
        """An independent grammar in the same state (shares only immutable compiled data)."""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """How many tokens (EOS included) have been accepted and not rolled back."""

    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (EOS would be allowed)."""
        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.fill_next_token_bitmask(mask, 0)
        eos = next(iter(self.eos_token_ids))
        return bool((int(mask[0, eos // 32]) >> (eos % 32)) & 1)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Accept all of `token_ids`, or none of them (state unchanged) if one is refused."""
        for num_done, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                self.rollback(num_done)
                return False
        return True

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Width of the logits this grammar masks."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """The stop tokens, allowed only in accepting states."""
