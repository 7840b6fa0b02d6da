"""Memory pools: the token-granular KV pool (per-layer K/V by slot id) and req_to_token."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V tensors of shape [num_slots + 1, num_kv_heads, head_dim].

    Row 0 is a padding slot that no request owns; slots 1..num_slots are handed out by
    `radix_cache.KVSlotAllocator`. Only the scheduler thread writes here, through the model.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # torch.empty: pages are committed only when a slot is first written.
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers):
            buf[0].zero_()
        self.bytes_per_slot = self.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class ReqToTokenPool:
    """Rows of [max_context_len] int32 slot ids, one row per running request.

    Row r, position p holds the KV slot of token p of the request that owns row r.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str) -> None:
        self.req_to_token = torch.zeros(
            (num_rows, max_context_len), dtype=torch.int32, device=device
        )
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert row not in self._free_rows, f"row {row} freed twice"
        self._free_rows.append(row)

    def reclaim(self, used_rows: set[int]) -> int:
        """Free every row that is neither free nor in `used_rows` (recovery after a fault)."""
        free = set(self._free_rows)
        lost = [r for r in range(self.req_to_token.shape[0]) if r not in free
                and r not in used_rows]
        self._free_rows.extend(lost)
        return len(lost)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        if slots:
            self.req_to_token[row, start : start + len(slots)] = torch.tensor(
                slots, dtype=torch.int32
            )

    def read(self, row: int, start: int, end: int) -> list[int]:
        return self.req_to_token[row, start:end].tolist()
