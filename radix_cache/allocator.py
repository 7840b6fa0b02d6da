"""Token-granular KV slot allocator: hands out and takes back slot ids 1..size."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["KVSlotAllocator"]


class KVSlotAllocator:
    """Free list of KV-pool slot ids, one slot per token.

    Slot 0 is reserved as a padding / scratch slot: it is never handed out, so
    the KV pool tensors have ``size + 1`` rows and padded positions may write
    to row 0 harmlessly. The free list is a stack (O(1) per slot).

    ``alloc`` is all-or-nothing. ``free`` of a slot that is out of range or
    already free is a caller bug and raises ``AssertionError`` without
    changing any state.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"KV pool size must be >= 1, got {size}")
        self._size = size
        self._free_slots: list[int] = []
        # is_free[slot] == 1 iff the slot is on the free list; index 0 unused.
        self._is_free = bytearray(size + 1)
        self.reset()

    @property
    def size(self) -> int:
        """Number of allocatable slots (the pool has ``size + 1`` rows)."""
        return self._size

    @property
    def num_free_slots(self) -> int:
        """Number of slots currently free."""
        return len(self._free_slots)

    def is_free(self, slot: int) -> bool:
        """Whether ``slot`` is currently on the free list."""
        return 1 <= slot <= self._size and self._is_free[slot] == 1

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free slots, or return None (taking none) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots: {n}")
        free_slots = self._free_slots
        if n > len(free_slots):
            return None
        if n == 0:
            return []
        slots = free_slots[-n:]
        del free_slots[-n:]
        slots.reverse()
        is_free = self._is_free
        for slot in slots:
            is_free[slot] = 0
        top = max(slots)
        if top > self._high_water:
            self._high_water = top
        return slots

    @property
    def high_water(self) -> int:
        """The highest slot id ever handed out. Fresh slots go out in increasing order and
        freed ones are reused first, so slots 1..high_water are all that were ever used
        (a lazily committed KV pool has touched only their pages)."""
        return self._high_water

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the free list (all of them, or none on error)."""
        slots = list(slots)
        is_free = self._is_free
        size = self._size
        for i, slot in enumerate(slots):
            if not 1 <= slot <= size or is_free[slot]:
                for done in slots[:i]:
                    is_free[done] = 0
                why = "out of range" if not 1 <= slot <= size else "already free"
                raise AssertionError(f"free of slot {slot}: {why} (pool size {size})")
            is_free[slot] = 1
        self._free_slots.extend(slots)

    def reset(self) -> None:
        """Mark every slot free again (forgets all outstanding allocations)."""
        # Reversed so that a fresh allocator hands out 1, 2, 3, ... in order.
        self._free_slots = list(range(self._size, 0, -1))
        self._is_free = bytearray(b"\x01") * (self._size + 1)
        self._is_free[0] = 0
        self._high_water = 0

    def __repr__(self) -> str:
        return f"KVSlotAllocator(size={self._size}, num_free_slots={self.num_free_slots})"
