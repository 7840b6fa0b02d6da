"""Radix tree node, match result, eviction priorities and the run-compare helper."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["EVICTION_POLICIES", "MatchResult", "TreeNode", "common_prefix_len"]

_node_ids = itertools.count()

# Chunk width used to narrow down a mismatch with C-level slice compares
# before falling back to a per-token loop inside one chunk.
_CHUNK = 32


class TreeNode:
    """One edge of the radix tree: a run of token ids and the KV slots holding them.

    ``key[i]`` is a token id and ``value[i]`` the KV slot of that token; both lists
    have the same non-zero length (only the root is empty). ``children`` is keyed
    by the first token of each child's run. ``lock_ref`` counts the requests whose
    locked path passes through this node; a node with ``lock_ref > 0`` is never
    evicted. ``last_access_time`` / ``hit_count`` drive LRU / LFU eviction (the time is a
    logical tick, unique per tree operation); ``access_wall`` is the same moment in
    ``time.monotonic()`` seconds, for people reading the tree (a dashboard's "last access").
    ``subtree_tokens`` counts the tokens of this node and all below it (kept by the tree on
    every insert, split and removal, so a bounded view needs no walk of the whole tree).
    """

    __slots__ = ("access_wall", "children", "hit_count", "id", "key", "last_access_time",
                 "lock_ref", "parent", "subtree_tokens", "value")

    def __init__(
        self,
        key: list[int],
        value: list[int],
        parent: TreeNode | None,
        last_access_time: int = 0,
        hit_count: int = 0,
        lock_ref: int = 0,
        access_wall: float = 0.0,
    ) -> None:
        self.id = next(_node_ids)
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time
        self.hit_count = hit_count
        self.access_wall = access_wall
        self.subtree_tokens = len(key)

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:
        # Only reached when two heap priorities tie; node ids make the order total.
        return self.id < other.id

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"t={self.last_access_time}, hits={self.hit_count})")


class MatchResult(NamedTuple):
    """Result of ``RadixCache.match_prefix``.

    ``slots``: KV slots of the longest cached prefix (its length is the number of
    cached tokens). ``last_node``: the node where that prefix ends (the root when
    nothing matched); lock it with ``inc_lock_ref`` to keep the prefix resident.
    """

    slots: list[int]
    last_node: TreeNode


def common_prefix_len(key: list[int], start: int, run: list[int]) -> int:
    """Length of the common prefix of ``key[start:]`` and ``run``."""
    n = min(len(run), len(key) - start)
    if n <= 0:
        return 0
    if n == len(run):
        if key[start:start + n] == run:
            return n
    elif key[start:start + n] == run[:n]:
        return n
    i = 0
    while i + _CHUNK <= n and key[start + i:start + i + _CHUNK] == run[i:i + _CHUNK]:
        i += _CHUNK
    while i < n and key[start + i] == run[i]:
        i += 1
    return i


def _lru_priority(node: TreeNode) -> tuple[int, ...]:
    return (node.last_access_time,)


def _lfu_priority(node: TreeNode) -> tuple[int, ...]:
    return (node.hit_count, node.last_access_time)


# Eviction policy name -> priority of a leaf; the smallest priority is evicted first.
EVICTION_POLICIES: dict[str, Callable[[TreeNode], tuple[int, ...]]] = {
    "lru": _lru_priority,
    "lfu": _lfu_priority,
}
