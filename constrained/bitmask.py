"""Packed allowed-token bitmasks: int32 [batch, ceil(vocab/32)], bit (j % 32) of word j // 32."""

from __future__ import annotations

import torch

_BITS_PER_WORD = 32
_shift_cache: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + _BITS_PER_WORD - 1) // _BITS_PER_WORD


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask (every bit set) of shape [batch, ceil(vocab_size / 32)]."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _shift_cache:
        _shift_cache[device] = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=device)
    return _shift_cache[device]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [batch, vocab_size]: True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits[b, j]` to -inf where bit j of `bitmask[b]` is clear, in place.

    logits: float [batch, vocab]; bitmask: int32 [batch, >= ceil(vocab / 32)], same device.
    Columns past the bitmask's width (if any) are disallowed.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        shapes = f"logits {tuple(logits.shape)}, bitmask {tuple(bitmask.shape)}"
        raise ValueError(f"shape mismatch: {shapes}")
    vocab_size = logits.shape[1]
    covered = min(vocab_size, bitmask.shape[1] * _BITS_PER_WORD)
    bitmask = bitmask.to(logits.device)
    disallowed = ((bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1) == 0
    disallowed = disallowed.reshape(len(bitmask), -1)[:, :covered]
    logits[:, :covered].masked_fill_(disallowed, float("-inf"))
    if covered < vocab_size:
        logits[:, covered:] = float("-inf")


def token_ids_to_words(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One int32 bitmask row [ceil(vocab_size / 32)] with exactly `token_ids` set."""
    token_ids = token_ids.to(torch.int64)
    words = torch.zeros(bitmask_width(vocab_size), dtype=torch.int64)
    # Bits of distinct ids never collide, so a sum per word is their OR.
    words.index_add_(0, token_ids >> 5, torch.ones_like(token_ids) << (token_ids & 31))
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def set_token_bits_(row: torch.Tensor, token_ids: list[int] | frozenset[int], value: bool) -> None:
    """Set or clear single bits of one int32 bitmask row in place."""
    for token_id in token_ids:
        word, bit = divmod(int(token_id), _BITS_PER_WORD)
        current = int(row[word]) & 0xFFFFFFFF
        current = current | (1 << bit) if value else current & ~(1 << bit)
        row[word] = current - 2**32 if current >= 2**31 else current
