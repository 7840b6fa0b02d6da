"""Tenants' namespaces in the radix tree (issue #49): the same tokens under two namespaces
share no node and no match; the shared namespace keeps plain keys."""

from __future__ import annotations

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.namespace import cache_namespace, tree_key, untag_token


def test_namespaces_share_nothing() -> None:
    tree = RadixCache(KVSlotAllocator(64))
    ids = [5, 6, 7, 8]
    a, b = cache_namespace("tenant-a"), cache_namespace("tenant-b")
    assert a != b and cache_namespace("tenant-a") == a and cache_namespace(None) is None
    slots = tree.allocator.alloc(4)
    tree.insert(tree_key(ids, a), slots)
    assert len(tree.match_prefix(tree_key(ids, a)).slots) == 4
    assert tree.match_prefix(tree_key(ids, b)).slots == []
    assert tree.match_prefix(ids).slots == []  # nor the shared namespace
    assert tree.peek(tree_key(ids, b)) == (0, 0)
    tree.insert(ids, tree.allocator.alloc(4))
    assert len(tree.match_prefix(ids).slots) == 4
    tree.check_integrity()


def test_keys_stay_int64_and_untag() -> None:
    for salt in ("a", "b" * 200, "\n"):
        ns = cache_namespace(salt)
        for token in (0, 1, 151_935, (1 << 32) - 1):
            key = tree_key([token, 3], ns)
            assert -(1 << 63) <= key[0] < 0 and key[1] == 3
            assert untag_token(key[0]) == token
    assert tree_key([1, 2], None) == [1, 2] and untag_token(7) == 7
    assert tree_key([], 5) == []
