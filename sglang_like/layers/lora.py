"""LoRA deltas on top of any linear method, gathered per row (S-LoRA / Punica's batching).

A request on an adapter adds `scale * B @ (A @ x)` to each targeted linear's output for its
rows; the base matmul runs once for the whole batch, whatever its format (dense, int8, int4,
GGUF blocks), and the low-rank terms are computed per adapter over that adapter's rows only.

An adapter's matrices for one fused linear (q/k/v, gate/up) are stored as one pair:
`a` [R, in] stacks the partitions' A rows, `b` [out, R] places each partition's B (with its
scale folded in) at that partition's output rows and rank columns, zeros elsewhere. So a
fused linear costs two small matmuls per adapter group, not two per partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LoraBatch", "LoraContext", "LoraLinearWeights", "apply_lora"]


@dataclass(frozen=True)
class LoraLinearWeights:
    """One adapter's low-rank pair for one (possibly fused) linear, float32."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R], the scale folded in


@dataclass
class LoraBatch:
    """A forward's rows by adapter: (the adapter's weights per linear key, its token rows).

    Rows on the base model appear in no group. `rows` is a slice where an adapter's rows are
    contiguous (requests are packed in order, so one request's rows always are)."""

    groups: list[tuple[dict[str, LoraLinearWeights], torch.Tensor | slice]] = field(
        default_factory=list)
    num_rows: int = 0
    _stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = field(
        default_factory=dict, repr=False)

    def stacked(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(slots [T], A [S, R, K], B [S, N, R]) of linear `key` for the stacked kernels
        (triton_ops.lora_delta_): the groups' pairs zero-padded to the largest rank, each
        row's slot its group (-1: none); None when no group has the linear. Once a forward."""
        if key in self._stacks:
            return self._stacks[key]
        pairs = [(w.get(key), rows) for w, rows in self.groups]
        present = [(w, rows) for w, rows in pairs if w is not None]
        if not present:
            self._stacks[key] = None
            return None
        w0 = present[0][0]
        rank = max(w.a.shape[0] for w, _ in present)
        dev = w0.a.device
        a = torch.zeros(len(present), rank, w0.a.shape[1], device=dev)
        b = torch.zeros(len(present), w0.b.shape[0], rank, device=dev)
        slots = torch.full((self.num_rows,), -1, dtype=torch.long, device=dev)
        for s, (w, rows) in enumerate(present):
            a[s, : w.a.shape[0]] = w.a
            b[s, :, : w.b.shape[1]] = w.b
            slots[rows] = s
        self._stacks[key] = (slots, a, b)
        return self._stacks[key]

    def row_groups(self) -> torch.Tensor:
        """int64 [num_rows]: each row's index in `groups` (-1: the base), on the CPU."""
        slots = torch.full((self.num_rows,), -1, dtype=torch.long)
        for g, (_, rows) in enumerate(self.groups):
            slots[rows.cpu() if isinstance(rows, torch.Tensor) else rows] = g
        return slots

    @staticmethod
    def from_row_groups(adapters: list[dict[str, LoraLinearWeights]], slots: torch.Tensor,
                        device: torch.device | str = "cpu") -> LoraBatch:
        """The batch whose `row_groups()` is `slots` [T] and whose groups' weights are
        `adapters` (a tensor-parallel rank rebuilds rank 0's batch with its own parts)."""
        groups: list[tuple[dict[str, LoraLinearWeights], torch.Tensor | slice]] = []
        for g, weights in enumerate(adapters):
            idx = (slots == g).nonzero().flatten()
            first, last = int(idx[0]), int(idx[-1])
            rows = (slice(first, last + 1) if last - first + 1 == len(idx)
                    else idx.to(device))
            groups.append((weights, rows))
        return LoraBatch(groups, int(slots.numel()))

    @staticmethod
    def build(adapters: list[dict[str, LoraLinearWeights] | None], extend_lens: list[int],
              device: torch.device | str = "cpu") -> LoraBatch | None:
        """From each request's adapter weights (None: the base) and its row count; None when
        no request of the batch has an adapter."""
        rows: dict[int, tuple[dict[str, LoraLinearWeights], list[int]]] = {}
        start = 0
        for weights, n in zip(adapters, extend_lens, strict=True):
            if weights is not None:
                rows.setdefault(id(weights), (weights, []))[1].extend(range(start, start + n))
            start += n
        if not rows:
            return None
        total = start
        groups: list[tuple[dict[str, LoraLinearWeights], torch.Tensor | slice]] = []
        for weights, idx in rows.values():
            if idx[-1] - idx[0] + 1 == len(idx):
                groups.append((weights, slice(idx[0], idx[-1] + 1)))
            else:
                groups.append((weights, torch.tensor(idx, dtype=torch.long, device=device)))
        return LoraBatch(groups, total)


class LoraContext:
    """What a model's LoRA-capable linears read during a forward: the batch's groups (set by
    the model around its layers; None between forwards and for base-only batches)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


def apply_lora(y: torch.Tensor, x: torch.Tensor, key: str, batch: LoraBatch) -> torch.Tensor:
    """`y` (the base linear's output for input `x`) plus every group's delta for linear
    `key`; float32 sums, added in y's dtype. Rows of adapters not targeting `key` are left.
    On CUDA one pair of Triton kernels over every row (the adapters stacked, Punica's BGMV);
    elsewhere two matmuls a group."""
    if y.is_cuda:
        stacked = batch.stacked(key)
        if stacked is None:
            return y
        from sglang_like_kernels import triton_ops

        y = y.clone()
        triton_ops.lora_delta_(y, x, *stacked)
        return y
    out = None
    for weights, rows in batch.groups:
        w = weights.get(key)
        if w is None:
            continue
        delta = (x[rows].float() @ w.a.t()) @ w.b.t()
        if out is None:
            out = y.clone() if y.dtype == torch.float32 else y.float()
        out[rows] += delta
    return y if out is None else out.to(y.dtype)
