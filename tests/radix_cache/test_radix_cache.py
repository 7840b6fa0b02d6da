"""Table-driven unit tests for RadixCache: match/split, insert, locks, eviction, modes."""

import pytest

from radix_cache import KVSlotAllocator, RadixCache, TreeNode


def _make(seqs: list[list[int]], size: int = 64, policy: str = "lru",
          disable: bool = False) -> tuple[KVSlotAllocator, RadixCache]:
    allocator = KVSlotAllocator(size)
    cache = RadixCache(allocator, eviction_policy=policy, disable=disable)
    for seq in seqs:
        _store(cache, seq)
    return allocator, cache


def _store(cache: RadixCache, seq: list[int]) -> int:
    """Insert ``seq`` like a request with no locked prefix; free the duplicates."""
    slots = cache.allocator.alloc(len(seq))
    assert slots is not None
    cached_len = cache.insert(seq, slots)
    cache.allocator.free(slots[:cached_len])
    return cached_len


def _stored(cache: RadixCache) -> set[tuple[int, ...]]:
    """Token sequences that end at a leaf of the tree."""
    out: set[tuple[int, ...]] = set()
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + tuple(node.key)
        if not node.children and node is not cache.root:
            out.add(path)
        stack.extend((child, path) for child in node.children.values())
    return out


def _assert_accounting(allocator: KVSlotAllocator, cache: RadixCache, held: int = 0) -> None:
    cache.check_integrity()
    total = allocator.num_free_slots + cache.evictable_size + cache.protected_size + held
    assert total == allocator.size


TREE = [[1, 2, 3, 4], [1, 2, 5, 6], [7]]


@pytest.mark.parametrize(
    ("query", "match_len", "num_nodes_after"),
    [
        ([1, 2, 3, 4, 9], 4, 4),  # nodes: [1 2] -> [3 4], [5 6]; [7]
        ([1, 2, 3, 4], 4, 4),
        ([1, 2], 2, 4),  # ends exactly at the shared node
        ([1, 2, 3], 3, 5),  # ends inside [3 4]: split
        ([1, 2, 5, 9], 3, 5),  # mismatch inside [5 6]: split
        ([1, 9], 1, 5),  # mismatch inside [1 2]: split
        ([8], 0, 4),
        ([], 0, 4),
        ([7, 7], 1, 4),
    ],
)
def test_match_prefix_lengths_and_splits(query: list[int], match_len: int,
                                         num_nodes_after: int) -> None:
    allocator, cache = _make(TREE)
    assert cache.num_nodes == 4
    full = {tuple(seq): cache.match_prefix(seq).slots for seq in TREE}
    result = cache.match_prefix(query)
    assert len(result.slots) == match_len
    assert cache.num_nodes == num_nodes_after
    # The matched slots are the slots stored for that prefix, whichever sequence holds it.
    owner = next((s for s in TREE if s[:match_len] == query[:match_len]), None)
    if match_len:
        assert result.slots == full[tuple(owner)][:match_len]
        path_len, node = 0, result.last_node
        while node is not cache.root:
            path_len += len(node.key)
            node = node.parent
        assert path_len == match_len  # last_node ends exactly at the match
    else:
        assert result.last_node is cache.root
    _assert_accounting(allocator, cache)


def test_match_prefix_accepts_tuples_and_marks_the_path() -> None:
    _, cache = _make([[1, 2, 3]])
    result = cache.match_prefix((1, 2))
    assert len(result.slots) == 2
    assert result.last_node.hit_count == 1
    child = next(iter(result.last_node.children.values()))
    assert child.hit_count == 0  # the split-off tail was not part of the match
    assert result.last_node.last_access_time > child.last_access_time


@pytest.mark.parametrize(
    ("seq", "expected"),
    [
        ([1, 2, 3, 4], 4),  # exact duplicate
        ([1, 2], 2),  # strict prefix of a stored run
        ([1, 2, 9], 2),  # diverges inside a run
        ([1, 2, 3, 4, 5, 6], 4),  # extends a leaf
        ([9, 9], 0),  # brand new
        ([], 0),
    ],
)
def test_insert_returns_previously_cached_length(seq: list[int], expected: int) -> None:
    allocator, cache = _make([[1, 2, 3, 4]])
    before = cache.total_size
    assert _store(cache, seq) == expected
    assert cache.total_size == before + len(seq) - expected
    assert len(cache.match_prefix(seq).slots) == len(seq)
    _assert_accounting(allocator, cache)


def test_insert_keeps_tree_slots_and_takes_only_the_new_tail() -> None:
    allocator, cache = _make([[1, 2, 3, 4]])
    tree_slots = cache.match_prefix([1, 2, 3, 4]).slots
    mine = allocator.alloc(3)
    assert mine is not None
    assert cache.insert([1, 2, 7], mine) == 2
    # Region [0, 2): the tree kept its own slots, mine[:2] are duplicates I must free.
    assert cache.match_prefix([1, 2, 7]).slots == tree_slots[:2] + mine[2:]
    assert not any(allocator.is_free(s) for s in mine)
    _assert_accounting(allocator, cache, held=2)  # mine[:2] are still held by the caller
    allocator.free(mine[:2])
    _assert_accounting(allocator, cache)


def test_insert_length_mismatch_is_value_error() -> None:
    _, cache = _make([])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1, 2])


def test_lock_moves_tokens_between_counters_along_the_path() -> None:
    allocator, cache = _make([[1, 2, 3, 4], [1, 2, 5]])  # [1 2] -> [3 4], [5]
    assert (cache.evictable_size, cache.protected_size) == (5, 0)
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert cache.inc_lock_ref(node) == 4
    assert (cache.evictable_size, cache.protected_size) == (1, 4)
    other = cache.match_prefix([1, 2, 5]).last_node
    assert cache.inc_lock_ref(other) == 1  # [1 2] was already protected
    assert cache.inc_lock_ref(node) == 0  # second lock on the same path
    assert (cache.evictable_size, cache.protected_size) == (0, 5)
    cache.check_integrity()
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 2  # [3 4] free again, [1 2] still held by [5]
    assert cache.dec_lock_ref(other) == 3
    assert (cache.evictable_size, cache.protected_size) == (5, 0)
    _assert_accounting(allocator, cache)
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(other)


def test_split_of_a_locked_node_keeps_lock_counts() -> None:
    allocator, cache = _make([[1, 2, 3, 4]])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    upper = cache.match_prefix([1, 2]).last_node  # splits the locked node
    assert upper.lock_ref == 1 and node.parent is upper
    assert (cache.evictable_size, cache.protected_size) == (0, 4)
    cache.check_integrity()
    cache.dec_lock_ref(node)
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    assert cache.evict(4) == 4
    _assert_accounting(allocator, cache)


A, B, C = [1, 1], [2, 2], [3, 3]


@pytest.mark.parametrize(
    ("policy", "eviction_order"),
    [
        # Stored A, B, C; then A matched 3 times, B once, C once (in that order).
        ("lru", [A, B, C]),  # oldest last access first
        ("lfu", [B, C, A]),  # fewest hits first, ties by recency
    ],
)
def test_eviction_order_per_policy(policy: str, eviction_order: list[list[int]]) -> None:
    allocator, cache = _make([A, B, C], policy=policy)
    for seq in [A, A, A, B, C]:
        cache.match_prefix(seq)
    remaining = {tuple(s) for s in (A, B, C)}
    for victim in eviction_order:
        assert cache.evict(1) == 2  # one whole leaf of 2 tokens
        remaining.discard(tuple(victim))
        assert _stored(cache) == remaining
        _assert_accounting(allocator, cache)


def test_unknown_policy_is_value_error() -> None:
    with pytest.raises(ValueError):
        RadixCache(KVSlotAllocator(4), eviction_policy="fifo")


def test_evict_climbs_to_parents_that_become_leaves() -> None:
    allocator, cache = _make([[1, 2, 3], [1, 2, 4], [9]])
    cache.match_prefix([9])  # most recent: should survive
    assert cache.evict(3) == 4  # [3], [4], then their parent [1 2]
    assert _stored(cache) == {(9,)}
    _assert_accounting(allocator, cache)


@pytest.mark.parametrize("request_tokens", [1, 5, 100])
def test_locked_nodes_are_never_evicted(request_tokens: int) -> None:
    allocator, cache = _make([[1, 2, 3], [1, 2, 4], [5, 6]])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    freed = cache.evict(request_tokens)
    assert freed >= min(request_tokens, 3)
    assert len(cache.match_prefix([1, 2, 3]).slots) == 3
    if request_tokens >= 3:
        assert _stored(cache) == {(1, 2, 3)}
        assert cache.evict(100) == 0
    _assert_accounting(allocator, cache)
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 6 - freed
    assert cache.total_size == 0 and allocator.num_free_slots == allocator.size


def test_evict_non_positive_is_noop() -> None:
    _, cache = _make([[1, 2]])
    assert cache.evict(0) == 0 and cache.evict(-5) == 0
    assert cache.total_size == 2


def test_disabled_cache_stores_nothing() -> None:
    allocator, cache = _make([], disable=True)
    slots = allocator.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 0
    result = cache.match_prefix([1, 2, 3])
    assert result.slots == [] and result.last_node is cache.root
    assert cache.total_size == 0 and cache.num_nodes == 0
    assert cache.inc_lock_ref(result.last_node) == 0
    assert cache.evict(10) == 0
    assert cache.insert_and_unlock([1, 2, 3], slots, result.last_node) == 3
    _assert_accounting(allocator, cache)


@pytest.mark.parametrize(
    ("stored", "seq", "expected_freed"),
    [
        ([], [1, 2, 3], 0),  # nothing cached: the tree takes all
        ([[1, 2, 3]], [1, 2, 3, 4], 0),  # locked prefix reused, tail taken
        ([[1, 2]], [1, 2, 3], 0),
    ],
)
def test_insert_and_unlock_request_flow(stored: list[list[int]], seq: list[int],
                                        expected_freed: int) -> None:
    allocator, cache = _make(stored)
    match = cache.match_prefix(seq)
    cache.inc_lock_ref(match.last_node)
    fresh = allocator.alloc(len(seq) - len(match.slots))
    assert fresh is not None
    held = len(fresh)
    _assert_accounting(allocator, cache, held=held)
    assert cache.insert_and_unlock(seq, match.slots + fresh, match.last_node) == expected_freed
    assert cache.protected_size == 0
    assert len(cache.match_prefix(seq).slots) == len(seq)
    _assert_accounting(allocator, cache)


def test_insert_and_unlock_frees_slots_computed_twice() -> None:
    # Two requests with the same prompt run at once; the second to finish frees its copy.
    allocator, cache = _make([])
    first, second = allocator.alloc(3), allocator.alloc(3)
    assert first is not None and second is not None
    assert cache.insert_and_unlock([4, 5, 6], first, cache.root) == 0
    assert cache.insert_and_unlock([4, 5, 6], second, cache.root) == 3
    assert all(allocator.is_free(s) for s in second)
    _assert_accounting(allocator, cache)


def test_reset_returns_all_tree_slots() -> None:
    allocator, cache = _make([[1, 2, 3], [1, 4]])
    cache.reset()
    assert cache.total_size == 0 and cache.num_nodes == 0
    assert allocator.num_free_slots == allocator.size
    assert cache.match_prefix([1, 2, 3]).slots == []
    _store(cache, [1, 2])  # still usable
    _assert_accounting(allocator, cache)


def test_reset_with_a_lock_is_an_assertion_error() -> None:
    _, cache = _make([[1, 2, 3]])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    with pytest.raises(AssertionError):
        cache.reset()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda c: setattr(c, "_evictable_size", c.evictable_size + 1),
        lambda c: setattr(c, "_protected_size", 1),
        lambda c: setattr(c, "_num_nodes", 7),
        lambda c: setattr(next(iter(c.root.children.values())), "lock_ref", 1),
        lambda c: next(iter(c.root.children.values())).value.append(60),
        lambda c: c.allocator.free(next(iter(c.root.children.values())).value[:1]),
        lambda c: c._evictable_leaves.clear(),
    ],
)
def test_check_integrity_catches_corruption(corrupt) -> None:  # noqa: ANN001
    _, cache = _make([[1, 2, 3], [1, 2, 4], [5]])
    cache.check_integrity()
    corrupt(cache)
    with pytest.raises(AssertionError, match="integrity"):
        cache.check_integrity()


def test_pretty_shows_structure() -> None:
    _, cache = _make([[1, 2, 3], [1, 2, 4], list(range(100, 120))])
    text = cache.pretty()
    lines = text.splitlines()
    assert lines[0].startswith("root (nodes=4")
    assert "  [1 2] " in text and "    [3] " in text and "    [4] " in text
    assert "...+12" in text  # 20 tokens shown as 8 plus a count
    assert len(lines) == 5
