"""Encoder outputs by image content hash (and crop): the same picture (in this request's next
prefill chunk, or another request) is encoded once. Bounded in bytes, least recently used first
out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if key in self._items or size > self.max_bytes:
            return
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        return {"crops": len(self._items), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses}
