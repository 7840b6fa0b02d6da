"""Hypothesis state machine: RadixCache + allocator against a naive prefix-set model.

The model is a dict from every cached token prefix (a tuple) to the KV slot of its
last token. Matches and inserts must agree with it exactly; evictions may remove
any unlocked part, so after each eviction the tree is read back and checked to be
a prefix-closed subset of the model that kept every locked prefix and freed
exactly the tokens it dropped.
"""

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radix_cache import KVSlotAllocator, RadixCache, TreeNode

_seqs = st.lists(st.integers(0, 3), min_size=1, max_size=10)

Prefix = tuple[int, ...]


@dataclass
class _Request:
    tokens: list[int]
    prefix_len: int
    slots: list[int]  # [0, prefix_len) from the tree, the rest allocated by the request
    last_node: TreeNode


def _read_tree(cache: RadixCache) -> dict[Prefix, int]:
    out: dict[Prefix, int] = {}
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, slot in enumerate(node.value):
            out[prefix + tuple(node.key[: i + 1])] = slot
        path = prefix + tuple(node.key)
        stack.extend((child, path) for child in node.children.values())
    return out


class RadixCacheMachine(RuleBasedStateMachine):
    """Random requests, matches, aborts and evictions against the naive model."""

    @initialize(size=st.integers(6, 40), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, size: int, policy: str) -> None:
        self.allocator = KVSlotAllocator(size)
        self.cache = RadixCache(self.allocator, eviction_policy=policy)
        self.model: dict[Prefix, int] = {}
        self.running: list[_Request] = []

    # ------------------------------------------------------------ model

    def _model_match(self, tokens: list[int]) -> list[int]:
        slots: list[int] = []
        for i in range(len(tokens)):
            slot = self.model.get(tuple(tokens[: i + 1]))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def _locked_prefixes(self) -> set[Prefix]:
        return {tuple(r.tokens[:i]) for r in self.running for i in range(1, r.prefix_len + 1)}

    def _checked_evict(self, num_tokens: int) -> int:
        evictable_before = self.cache.evictable_size
        freed = self.cache.evict(num_tokens)
        after = _read_tree(self.cache)
        assert all(self.model.get(p) == s for p, s in after.items()), "evict invented tokens"
        assert self._locked_prefixes() <= after.keys(), "evict removed a locked prefix"
        dropped = self.model.keys() - after.keys()
        assert len(dropped) == freed
        assert all(self.allocator.is_free(self.model[p]) for p in dropped)
        assert freed >= min(num_tokens, evictable_before)
        self.model = after
        return freed

    def _alloc(self, n: int) -> list[int] | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self._checked_evict(n - self.allocator.num_free_slots)
            slots = self.allocator.alloc(n)
        return slots

    def _check_match(self, tokens: list[int]) -> _Request:
        expected = self._model_match(tokens)
        result = self.cache.match_prefix(tokens)
        assert result.slots == expected
        return _Request(tokens, len(expected), list(result.slots), result.last_node)

    def _record_insert(self, req: _Request, cached_len: int) -> None:
        assert cached_len == len(self._model_match(req.tokens))
        for i in range(cached_len, len(req.tokens)):
            self.model[tuple(req.tokens[: i + 1])] = req.slots[i]

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.running) < 4)
    @rule(tokens=_seqs)
    def start_request(self, tokens: list[int]) -> None:
        req = self._check_match(tokens)
        self.cache.inc_lock_ref(req.last_node)
        fresh = self._alloc(len(tokens) - req.prefix_len)
        if fresh is None:  # pool too small even after eviction: give up this request
            self.cache.dec_lock_ref(req.last_node)
            return
        req.slots += fresh
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), use_helper=st.booleans())
    def finish_request(self, data: st.DataObject, use_helper: bool) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        if use_helper:
            expected_cached = len(self._model_match(req.tokens))
            num_freed = self.cache.insert_and_unlock(req.tokens, req.slots, req.last_node)
            assert num_freed == expected_cached - req.prefix_len
            self._record_insert(req, expected_cached)
            return
        cached_len = self.cache.insert(req.tokens, req.slots)
        self._record_insert(req, cached_len)
        self.allocator.free(req.slots[req.prefix_len:cached_len])
        self.cache.dec_lock_ref(req.last_node)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.allocator.free(req.slots[req.prefix_len:])
        self.cache.dec_lock_ref(req.last_node)

    @rule(tokens=_seqs)
    def insert_directly(self, tokens: list[int]) -> None:
        slots = self._alloc(len(tokens))
        if slots is None:
            return
        req = _Request(tokens, 0, slots, self.cache.root)
        cached_len = self.cache.insert(tokens, slots)
        self._record_insert(req, cached_len)
        self.allocator.free(slots[:cached_len])

    @rule(tokens=_seqs)
    def match(self, tokens: list[int]) -> None:
        self._check_match(tokens)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens: int) -> None:
        self._checked_evict(num_tokens)

    # ------------------------------------------------------------ invariants

    @invariant()
    def accounting_holds(self) -> None:
        held = sum(len(r.slots) - r.prefix_len for r in self.running)
        cache = self.cache
        assert (self.allocator.num_free_slots + cache.evictable_size + cache.protected_size
                + held == self.allocator.size)
        assert cache.protected_size == len(self._locked_prefixes())
        assert cache.total_size == len(self.model)
        cache.check_integrity()

    def teardown(self) -> None:
        for req in self.running:
            self.allocator.free(req.slots[req.prefix_len:])
            self.cache.dec_lock_ref(req.last_node)
        self.cache.reset()
        assert self.allocator.num_free_slots == self.allocator.size


RadixCacheMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
