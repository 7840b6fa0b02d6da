"""The adapters an engine serves: names, load order, pins, and who uses them now.

Lives in the engine core and is touched on its loop thread only. An adapter's weights are
read and fitted off the loop (by the Engine, `lora.adapter.read_adapter`); installing them
here is a dict insert. A request holds its adapter's weights from admission to its end, so
unloading (or evicting) an adapter never fails a request in flight: it finishes on the
weights it started with, and later requests naming the adapter are refused.

Under tensor parallelism the registry is rank 0's: each adapter installed goes through the
group (`LoraSharding`), which sends it to the other ranks and hands back rank 0's own part,
the weights rank 0's requests then hold.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglang_like.lora.adapter import LoraAdapter

__all__ = ["LoadedAdapter", "LoraRegistry", "LoraSharding"]

logger = logging.getLogger(__name__)
_uids = itertools.count(1)


@dataclass
class LoadedAdapter:
    adapter: LoraAdapter
    pinned: bool
    # every load gets a new id: the radix cache keys KV by it, so a name reloaded with other
    # weights never reuses the KV its old weights computed
    uid: int = field(default_factory=lambda: next(_uids))
    last_used: float = field(default_factory=time.monotonic)
    in_flight: int = 0  # requests that hold it now
    is_loaded: bool = True  # False once unloaded or evicted (requests in flight may hold it)

    @property
    def name(self) -> str:
        return self.adapter.name

    def info(self) -> dict[str, Any]:
        return {**self.adapter.info(), "pinned": self.pinned, "in_flight": self.in_flight}


class LoraSharding(Protocol):
    """The other tensor-parallel ranks, as the registry reaches them (`tp.group.TPGroup`)."""

    def install_lora(self, entry: LoadedAdapter) -> LoraAdapter:
        """Send `entry.adapter` (whole) to the other ranks, each of which keeps its part
        until no request holds the entry any more (`is_loaded` False, `in_flight` 0); rank
        0's part. ValueError, nothing sent, when the adapter cannot be cut."""
        ...


class LoraRegistry:
    """Loaded adapters by name. With `max_loaded` set, loading past it evicts (unloads) the
    least recently used adapter that is unpinned and used by no request, and is refused when
    there is none. With `sharding` (tensor parallelism), adapters are installed through it."""

    def __init__(self, max_loaded: int | None = None,
                 sharding: LoraSharding | None = None) -> None:
        self.max_loaded = max_loaded
        self.sharding = sharding
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._loaded

    def __len__(self) -> int:
        return len(self._loaded)

    def names(self) -> list[str]:
        return list(self._loaded)

    def get(self, name: str) -> LoadedAdapter | None:
        return self._loaded.get(name)

    def install(self, adapter: LoraAdapter, pinned: bool = False) -> list[str]:
        """Add `adapter`; the names evicted to make room. ValueError when its name is taken
        or there is no room."""
        if adapter.name in self._loaded:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded; "
                             f"unload it first")
        victim = None
        if self.max_loaded is not None and len(self._loaded) >= self.max_loaded:
            idle = [e for e in self._loaded.values() if not e.pinned and e.in_flight == 0]
            if not idle:
                raise ValueError(f"{len(self._loaded)} LoRA adapters are loaded "
                                 f"(--max-loaded-loras {self.max_loaded}) and none can be "
                                 f"evicted (pinned or in use)")
            victim = min(idle, key=lambda e: e.last_used)
        entry = LoadedAdapter(adapter, pinned)
        if self.sharding is not None:  # before the eviction: a refusal here changes nothing
            entry.adapter = self.sharding.install_lora(entry)
        evicted: list[str] = []
        if victim is not None:
            del self._loaded[victim.name]
            victim.is_loaded = False
            evicted.append(victim.name)
            logger.info("LoRA adapter %r evicted (least recently used) to load %r",
                        victim.name, adapter.name)
        self._loaded[adapter.name] = entry
        logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MB%s)", adapter.name,
                    adapter.path, adapter.rank, adapter.nbytes / 1e6, ", pinned" if pinned else "")
        return evicted

    def unload(self, name: str) -> LoadedAdapter:
        entry = self._loaded.pop(name, None)
        if entry is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        entry.is_loaded = False
        logger.info("LoRA adapter %r unloaded (%d requests still finish on it)", name,
                    entry.in_flight)
        return entry

    def acquire(self, name: str) -> LoadedAdapter | None:
        """The adapter a new request runs on (counted as in use until `release`)."""
        entry = self._loaded.get(name)
        if entry is not None:
            entry.in_flight += 1
            entry.last_used = time.monotonic()
        return entry

    @staticmethod
    def release(entry: LoadedAdapter) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()

    def info(self) -> list[dict[str, Any]]:
        return [e.info() for e in self._loaded.values()]
