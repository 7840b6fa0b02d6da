"""Memory pools: the token-granular KV pool (per-layer K/V by slot id) and req_to_token."""

from __future__ import annotations

import torch

from sglang_like.config import KV_CACHE_DTYPES
from sglang_like.utils.upload import Packer
from sglang_like_kernels import kv_quant

# --kv-cache-dtype's values (ServerArgs.kv_cache_dtype): "auto" (the activations' dtype, see
# resolve_kv_cache_dtype), a float pool, or a quantized one (8-bit codes and a float32 scale
# per token and KV head, sglang_like_kernels.kv_quant). "fp8" is vLLM's name for e4m3; the
# torch names a resolved ServerArgs carries ("float8_e4m3fn", ...) are taken back as well.
_KV_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "int8": torch.int8,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(name: str, default: torch.dtype) -> torch.dtype:
    """The pool dtype `--kv-cache-dtype name` asks for (`default` for "auto"); a ValueError
    naming the choices for anything else."""
    if name == "auto":
        return default
    dtype = _KV_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {name!r}")
    return dtype


class KVPool:
    """Per-layer K and V tensors of shape [num_slots + 1, num_kv_heads, head_dim].

    Row 0 is a padding slot that no request owns; slots 1..num_slots are handed out by
    `radix_cache.KVSlotAllocator`. Only the scheduler thread writes here, through the model.
    A quantized `dtype` (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2) makes the
    buffers codes, with per-layer scales beside them in `k_scales` / `v_scales` [num_slots +
    1, num_kv_heads] float32 (None for a float pool), which every write and read passes on.
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
        self.dtype = dtype
        self.quantized = kv_quant.is_quantized(dtype)
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        if self.quantized:
            scale_shape = (num_slots + 1, num_kv_heads)
            self.k_scales = [torch.empty(scale_shape, dtype=torch.float32, device=device)
                             for _ in range(num_layers)]
            self.v_scales = [torch.empty(scale_shape, dtype=torch.float32, device=device)
                             for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers, *(self.k_scales or ()),
                    *(self.v_scales or ())):
            kv_quant.as_bytes(buf[0]).zero_()
        self.bytes_per_slot = self.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                            torch.Tensor | None, torch.Tensor | None]:
        """(K, V, K scales, V scales) of one layer; the scales None for a float pool."""
        if self.k_scales is None:
            return self.k_buffers[layer_id], self.v_buffers[layer_id], None, None
        return (self.k_buffers[layer_id], self.v_buffers[layer_id], self.k_scales[layer_id],
                self.v_scales[layer_id])

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one token over every layer, a quantized pool's scales included."""
        element = torch.iinfo(dtype).bits if dtype == torch.int8 else torch.finfo(dtype).bits
        per_head = head_dim * element // 8 + (4 if kv_quant.is_quantized(dtype) else 0)
        return 2 * num_layers * num_kv_heads * per_head


class ReqToTokenPool:
    """Rows of [max_context_len] int32 slot ids, one row per running request.

    Row r, position p holds the KV slot of token p of the request that owns row r.

    Off the CPU the scheduler's writes (`write` / `write_one`; the model only reads the table)
    land in a host copy of the rows, which `read` answers from (a read of the device's table
    would be a device-to-host sync, and the scheduler reads a request's slots back after each
    prefill and at its end), and wait there until the table is next asked for
    (`req_to_token`): then they cross in one copy, not one per request and step.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str) -> None:
        self._table = torch.zeros(
            (num_rows, max_context_len), dtype=torch.int32, device=device
        )
        self._free_rows = list(range(num_rows - 1, -1, -1))
        on_host = torch.device(device).type == "cpu"
        # the host copy: per row, its slots up to the furthest position written; and the
        # writes not on the device yet, slot by flat index (a later write to a position wins)
        # (both None on CPU, where the table itself is host memory)
        self._host_rows: list[list[int]] | None = (
            None if on_host else [[] for _ in range(num_rows)])
        self._pending: dict[int, int] | None = None if on_host else {}

    @property
    def req_to_token(self) -> torch.Tensor:
        """The table [num_rows, max_context_len] int32 on the pool's device, every write in."""
        if self._pending:
            self._flush()
        return self._table

    def _flush(self) -> None:
        pack = Packer()
        pack.add(list(self._pending))
        pack.add(list(self._pending.values()))
        flat, slots = pack.to(self._table.device)
        self._table.view(-1)[flat] = slots.to(torch.int32)
        self._pending.clear()

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
        lost = [r for r in range(self._table.shape[0]) if r not in free
                and r not in used_rows]
        self._free_rows.extend(lost)
        return len(lost)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        if not slots:
            return
        if self._host_rows is None:
            self._table[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32)
        else:
            self._write_host(row, start, slots)

    def write_one(self, row: int, position: int, slot: int) -> None:
        """`write(row, position, [slot])` without building a tensor (a verify's walk)."""
        if self._host_rows is None:
            self._table[row, position] = slot
        else:
            self._write_host(row, position, [slot])

    def _write_host(self, row: int, start: int, slots: list[int]) -> None:
        host = self._host_rows[row]
        if len(host) < start:
            host.extend([0] * (start - len(host)))
        host[start : start + len(slots)] = slots
        base = row * self._table.shape[1] + start
        self._pending.update(zip(range(base, base + len(slots)), slots, strict=True))

    def read(self, row: int, start: int, end: int) -> list[int]:
        if self._host_rows is not None:
            return self._host_rows[row][start:end]
        return self.req_to_token[row, start:end].tolist()
