"""Radix tree over token ids plus the token-granular KV slot allocator (pure Python ints)."""

from radix_cache.allocator import KVSlotAllocator
from radix_cache.radix_cache import RadixCache
from radix_cache.tree_node import MatchResult, TreeNode

__all__ = ["KVSlotAllocator", "MatchResult", "RadixCache", "TreeNode"]
