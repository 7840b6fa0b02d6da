"""radix_cache.snapshot: a scripted tree (known inserts, locks, evictions) gives exactly the
expected structure; max_nodes bounds the answer; looking never changes the tree."""

import pytest

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.snapshot import find_node, match_view, node_detail, snapshot


def _store(cache: RadixCache, seq: list[int]) -> None:
    slots = cache.allocator.alloc(len(seq))
    cached = cache.insert(seq, slots)
    cache.allocator.free(slots[:cached])


def _scripted() -> RadixCache:
    """root -> A[1 2 3 4] -> B[5 6] , C[7 8 9] ;  root -> D[20 21]"""
    cache = RadixCache(KVSlotAllocator(64))
    _store(cache, [1, 2, 3, 4, 5, 6])
    _store(cache, [1, 2, 3, 4, 7, 8, 9])
    _store(cache, [20, 21])
    return cache


def _shape(snap: dict) -> list[tuple]:
    """(parent's first token, own tokens, start, state, subtree) per node, root excluded."""
    first = {n["id"]: (n["token_ids"][0] if n["token_ids"] else None) for n in snap["nodes"]}
    return [(first[n["parent"]], n["token_ids"], n["start"], n["state"], n["subtree_tokens"])
            for n in snap["nodes"][1:]]


def test_structure_of_a_scripted_tree():
    cache = _scripted()
    snap = snapshot(cache)
    assert snap["num_nodes"] == 4 and snap["shown_nodes"] == 4 and not snap["truncated"]
    assert snap["total_tokens"] == 11 and snap["evictable_tokens"] == 11
    assert snap["locked_tokens"] == 0 and snap["evicted_tokens"] == 0
    root = snap["nodes"][0]
    assert root["parent"] is None and root["state"] == "root" and root["subtree_tokens"] == 11
    # pre-order, children in insertion order
    assert _shape(snap) == [
        (None, [1, 2, 3, 4], 0, "evictable", 9),
        (1, [5, 6], 4, "evictable", 2),
        (1, [7, 8, 9], 4, "evictable", 3),
        (None, [20, 21], 0, "evictable", 2),
    ]
    a = snap["nodes"][1]
    assert a["num_children"] == 2 and a["hidden_children"] == 0 and a["tokens"] == 4
    assert a["hit_count"] == 0 and a["idle_s"] is not None and a["idle_s"] >= 0
    cache.check_integrity()


def test_locks_holders_and_eviction_order():
    cache = _scripted()
    # a request holding [1 2 3 4 7 8 9]: C and A are locked, B and D are not
    match = cache.match_prefix([1, 2, 3, 4, 7, 8, 9])
    cache.inc_lock_ref(match.last_node)
    snap = snapshot(cache, holders=[("req-1", match.last_node)], next_evict=8)
    by_tokens = {tuple(n["token_ids"]): n for n in snap["nodes"][1:]}
    a, b, c, d = (by_tokens[k] for k in [(1, 2, 3, 4), (5, 6), (7, 8, 9), (20, 21)])
    assert (a["state"], a["lock_ref"], a["holders"]) == ("locked", 1, ["req-1"])
    assert (c["state"], c["holders"], c["num_holders"]) == ("locked", ["req-1"], 1)
    assert (b["state"], b["holders"]) == ("evictable", [])
    assert snap["locked_tokens"] == 7 and snap["evictable_tokens"] == 4
    # LRU: B was stored first and not touched since, D after it; the locked leaf is no candidate
    ranks = (b["evict_rank"], d["evict_rank"], c["evict_rank"], a["evict_rank"])
    assert ranks == (1, 2, None, None)
    # the match counted hits on its path only
    assert (a["hit_count"], c["hit_count"], b["hit_count"]) == (1, 1, 0)
    # evict two tokens: B goes (first in order), the counter says so
    assert cache.evict(2) == 2
    snap = snapshot(cache)
    assert snap["evicted_tokens"] == 2 and snap["num_nodes"] == 3
    assert [n["token_ids"] for n in snap["nodes"][1:]] == [[1, 2, 3, 4], [7, 8, 9], [20, 21]]
    cache.dec_lock_ref(match.last_node)
    cache.check_integrity()


def test_max_nodes_keeps_the_largest_branches_and_says_what_it_hides():
    cache = RadixCache(KVSlotAllocator(4096))
    # a 100-token shared prefix with 30 branches of 1..30 tokens
    prefix = list(range(1000, 1100))
    for i in range(30):
        _store(cache, prefix + [5000 + i] + [7] * i)
    assert cache.num_nodes == 31
    snap = snapshot(cache, max_nodes=5)
    assert snap["shown_nodes"] == 5 and snap["truncated"] and len(snap["nodes"]) == 6
    shared = snap["nodes"][1]
    assert shared["tokens"] == 100 and shared["num_children"] == 30
    kept = sorted(n["tokens"] for n in snap["nodes"][2:])
    assert kept == [27, 28, 29, 30]  # branch i holds i + 1 tokens: the four largest
    assert shared["hidden_children"] == 26
    assert shared["hidden_tokens"] == sum(range(1, 27))
    # every kept node's parent is kept
    ids = {n["id"] for n in snap["nodes"]}
    assert all(n["parent"] in ids for n in snap["nodes"][1:])
    assert snapshot(cache, max_nodes=0)["nodes"][0]["hidden_children"] == 1
    assert len(snapshot(cache, max_nodes=1000)["nodes"]) == 32


def test_edge_tokens_truncates_token_ids():
    cache = _scripted()
    snap = snapshot(cache, edge_tokens=2)
    assert snap["nodes"][1]["token_ids"] == [1, 2] and snap["nodes"][1]["tokens"] == 4
    with pytest.raises(ValueError):
        snapshot(cache, max_nodes=-1)


def test_looking_does_not_change_the_tree():
    cache = _scripted()
    before = cache.pretty()
    snapshot(cache)
    view = match_view(cache, [1, 2, 3, 9])
    node_detail(cache, cache.root.children[1].id)
    assert cache.pretty() == before  # no split, no access time, no hit
    assert view == {"num_tokens": 4, "matched_tokens": 3, "ends_inside": True,
                    "path": [{"id": cache.root.children[1].id, "tokens": 4, "matched": 3}]}


def test_match_view_paths():
    cache = _scripted()
    a = cache.root.children[1]
    c = a.children[7]
    assert match_view(cache, [1, 2, 3, 4, 7, 8, 9, 10]) == {
        "num_tokens": 8, "matched_tokens": 7, "ends_inside": False,
        "path": [{"id": a.id, "tokens": 4, "matched": 4}, {"id": c.id, "tokens": 3, "matched": 3}],
    }
    assert match_view(cache, [99])["matched_tokens"] == 0
    assert match_view(cache, [])["path"] == []
    # what match_prefix then finds is the same length
    assert len(cache.match_prefix([1, 2, 3, 4, 7, 8, 9, 10]).slots) == 7


def test_node_detail_gives_the_whole_prefix():
    cache = _scripted()
    c = cache.root.children[1].children[7]
    detail = node_detail(cache, c.id, holders=[("r", c)])
    assert detail["token_ids"] == [7, 8, 9]
    assert detail["prefix_token_ids"] == [1, 2, 3, 4, 7, 8, 9]
    assert detail["start"] == 4 and detail["holders"] == ["r"]
    assert detail["path"] == [cache.root.id, cache.root.children[1].id, c.id]
    assert node_detail(cache, -5) is None
    assert find_node(cache, c.id) is c
    cache.evict(100)
    assert node_detail(cache, c.id) is None


def test_ten_thousand_nodes_are_bounded():
    cache = RadixCache(KVSlotAllocator(60_000))
    for i in range(5000):  # 50 shared first tokens (split off), 5000 leaves under them
        _store(cache, [i % 50, 10_000 + i, 20_000 + i])
    assert cache.num_nodes >= 5000
    snap = snapshot(cache, max_nodes=500)
    assert snap["shown_nodes"] == 500 and len(snap["nodes"]) == 501
    hidden = sum(n["hidden_children"] for n in snap["nodes"])
    assert hidden > 0
    full = snapshot(cache, max_nodes=20_000)
    assert full["shown_nodes"] == cache.num_nodes and not full["truncated"]


def test_eviction_order_is_what_evict_takes():
    """eviction_order(k) reads the heap without popping it: the same leaves, in the same
    order, as evict() then removes one by one (LRU and LFU, with stale heap entries)."""
    import random

    for policy in ("lru", "lfu"):
        rng = random.Random(5)
        cache = RadixCache(KVSlotAllocator(4096), eviction_policy=policy)
        seqs = [[rng.randrange(6), rng.randrange(50), *range(100, 100 + rng.randrange(1, 4))]
                for _ in range(120)]
        for seq in seqs:
            _store(cache, seq)
        for seq in rng.sample(seqs, 60):  # touches: hits and newer access times (stale entries)
            cache.match_prefix(seq)
        order = cache.eviction_order(10)
        assert len(order) == 10 and len(set(order)) == 10
        taken = []
        for _ in range(10):
            leaf = min(cache._evictable_leaves, key=lambda n: (cache._priority(n), n))
            taken.append(leaf)
            assert cache.evict(1) == len(leaf.key)
        assert order == taken, policy
        cache.check_integrity()
    assert RadixCache(KVSlotAllocator(8)).eviction_order(3) == []
