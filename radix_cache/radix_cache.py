"""Radix tree over token ids that owns KV slots of cached prefixes (page size 1)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

from radix_cache.allocator import KVSlotAllocator
from radix_cache.tree_node import EVICTION_POLICIES, MatchResult, TreeNode, common_prefix_len

__all__ = ["RadixCache"]

_PRETTY_MAX_TOKENS = 8


def _check(cond: bool, msg: str) -> None:
    # Explicit raise so integrity checks still run under `python -O`.
    if not cond:
        raise AssertionError(f"radix cache integrity: {msg}")


class RadixCache:
    """Prefix cache: a radix tree whose nodes own the KV slots of their tokens.

    ``eviction_policy`` is "lru" (oldest access first) or "lfu" (fewest hits, then
    oldest); ``disable=True`` turns it into a no-op cache that never matches.

    Lifecycle of one request: ``match_prefix`` -> ``inc_lock_ref(last_node)`` ->
    allocate slots for the rest (``evict`` when the allocator is short) -> run ->
    ``insert`` -> free the duplicates -> ``dec_lock_ref(last_node)``
    (``insert_and_unlock`` does the last three steps).

    Every slot the tree holds is counted in exactly one of ``evictable_size``
    (on nodes with ``lock_ref == 0``) and ``protected_size`` (locked), so:

        allocator.num_free_slots + evictable_size + protected_size
            + slots held by running requests outside the tree == allocator.size

    The counters and the set of evictable leaves are kept incrementally; lock
    operations cost O(depth) and ``evict`` never walks the whole tree.
    """

    def __init__(
        self,
        allocator: KVSlotAllocator,
        eviction_policy: str = "lru",
        disable: bool = False,
    ) -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; "
                             f"expected one of {sorted(EVICTION_POLICIES)}")
        self.allocator = allocator
        self.eviction_policy = eviction_policy
        self.disable = disable
        self._priority = EVICTION_POLICIES[eviction_policy]
        # Tokens evicted over the cache's life (resets do not count): eviction pressure.
        self.evicted_tokens = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode([], [], None)
        self._clock = 0
        self._wall = 0.0  # time.monotonic() of the last tick
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0
        # Nodes (never the root) with no children and lock_ref == 0: eviction candidates.
        self._evictable_leaves: set[TreeNode] = set()
        # (priority, leaf) for every evictable leaf, kept across evict calls; an entry is
        # stale once its leaf left the set or was touched since (a newer entry exists).
        self._heap: list[tuple[tuple, TreeNode]] = []

    # ----------------------------------------------------------------- sizes

    @property
    def evictable_size(self) -> int:
        """Tokens (= slots) held by unlocked nodes."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens (= slots) held by locked nodes."""
        return self._protected_size

    @property
    def total_size(self) -> int:
        """All tokens (= slots) held by the tree."""
        return self._evictable_size + self._protected_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes, not counting the root."""
        return self._num_nodes

    # ---------------------------------------------------------- match/insert

    def match_prefix(self, token_ids: Sequence[int], count_hit: bool = True) -> MatchResult:
        """Find the longest cached prefix of ``token_ids``.

        Splits the last node when the match ends inside it, so ``last_node``
        always ends exactly at the matched length. Marks every node on the path
        as accessed (recency, and a hit unless ``count_hit=False``: a request
        re-locking what it just inserted is not a new use). Disabled: always
        empty at the root.
        """
        if self.disable or len(token_ids) == 0:
            return MatchResult([], self.root)
        key = token_ids if isinstance(token_ids, list) else list(token_ids)
        tick = self._tick()
        node = self.root
        slots: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched_len = common_prefix_len(key, pos, child.key)
            ends_inside = matched_len < len(child.key)
            if ends_inside:
                child = self._split(child, matched_len)
            child.last_access_time = tick
            child.access_wall = self._wall
            child.hit_count += count_hit
            if child in self._evictable_leaves:
                self._push(child)
            slots += child.value
            node = child
            pos += matched_len
            if ends_inside:
                break
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Store ``token_ids`` with their KV ``slots``; return the cached length before.

        The return value ``ret`` is how many leading tokens were already in the
        tree. The tree keeps its own slots for those and takes only the caller's
        slots after them. With ``prefix_len`` = ``len(match.slots)`` of the
        caller's earlier (locked) ``match_prefix``, the caller's ``slots`` split as:

            positions            owned after insert by   caller must
            [0, prefix_len)      tree (same slot ids)    nothing
            [prefix_len, ret)    tree, with its own ids  free these (duplicates)
            [ret, len)           tree (takes them)       nothing

        ``ret >= prefix_len`` holds while the matched prefix stays locked.
        Disabled: inserts nothing and returns 0; the caller frees all its slots.
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} token ids but {len(slots)} slots")
        if self.disable or len(token_ids) == 0:
            return 0
        key = token_ids if isinstance(token_ids, list) else list(token_ids)
        tick = self._tick()
        node = self.root
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                self._add_leaf(node, key[pos:], list(slots[pos:]), tick)
                return pos
            matched_len = common_prefix_len(key, pos, child.key)
            if matched_len < len(child.key):
                if pos + matched_len == len(key):
                    self._touch(child, tick)  # ends inside child: nothing to add
                    return len(key)
                child = self._split(child, matched_len)
            self._touch(child, tick)
            node = child
            pos += matched_len
        return len(key)

    def insert_and_unlock(
        self, token_ids: Sequence[int], slots: Sequence[int], last_node: TreeNode
    ) -> int:
        """Finish a request: ``insert``, free the caller's duplicates, unlock ``last_node``.

        ``last_node`` is the node the caller locked after ``match_prefix`` (the
        root when nothing matched); ``slots[:prefix_len]`` must be the slots that
        match returned. Works the same when disabled (then every slot is freed).
        Returns how many of the caller's slots were freed.
        """
        prefix_len = self._path_len(last_node)
        if self.disable:
            to_free = list(slots)
        else:
            cached_len = self.insert(token_ids, slots)
            assert cached_len >= prefix_len, "locked prefix vanished before insert"
            to_free = list(slots[prefix_len:cached_len])
        self.allocator.free(to_free)
        self.dec_lock_ref(last_node)
        return len(to_free)

    # ----------------------------------------------------------------- locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node; return how many tokens became protected."""
        num_moved = 0
        root = self.root
        while node is not root:
            assert node is not None, "inc_lock_ref on a node that is no longer in the tree"
            if node.lock_ref == 0:
                num_moved += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        self._evictable_size -= num_moved
        self._protected_size += num_moved
        return num_moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path root..node; return how many tokens became evictable."""
        num_moved = 0
        root = self.root
        while node is not root:
            assert node is not None, "dec_lock_ref on a node that is no longer in the tree"
            assert node.lock_ref > 0, f"dec_lock_ref below zero on {node!r}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                num_moved += len(node.key)
                if not node.children:
                    self._add_evictable(node)
            node = node.parent
        self._evictable_size += num_moved
        self._protected_size -= num_moved
        return num_moved

    # -------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots if possible; return how many were freed.

        Removes unlocked leaves in policy order (LRU: oldest access first; LFU:
        fewest hits, then oldest). A parent left as an unlocked leaf joins the
        heap, so whole unlocked branches can go in one call.
        """
        if self.disable or num_tokens <= 0 or not self._evictable_leaves:
            return 0
        priority, heap, leaves = self._priority, self._heap, self._evictable_leaves
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            key, leaf = heapq.heappop(heap)
            if leaf not in leaves or key != priority(leaf):
                continue  # stale: evicted, locked, grown children, or touched since
            freed += leaf.value
            self._remove_leaf(leaf)  # a parent left an unlocked leaf is pushed
        self.allocator.free(freed)
        self.evicted_tokens += len(freed)
        return len(freed)

    def eviction_order(self, k: int) -> list[TreeNode]:
        """The first ``k`` leaves ``evict`` would take now, in order (a read-only look: the
        parents that would become leaves on the way are not predicted).

        Reads the eviction heap in sorted order without popping it (a second heap over its
        indices): O(k log k) plus the stale entries met on the way, not O(leaves)."""
        heap, leaves, priority = self._heap, self._evictable_leaves, self._priority
        if self.disable or k <= 0 or not heap:
            return []
        out: list[TreeNode] = []
        seen: set[TreeNode] = set()
        candidates = [(heap[0], 0)]
        while candidates and len(out) < k:
            (key, leaf), i = heapq.heappop(candidates)
            if leaf in leaves and leaf not in seen and key == priority(leaf):
                out.append(leaf)
                seen.add(leaf)
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(heap):
                    heapq.heappush(candidates, (heap[j], j))
        return out

    def held_slots(self) -> list[int]:
        """Every slot the tree holds (a walk of the whole tree: for recovery and checks)."""
        slots: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            slots += node.value
            stack.extend(node.children.values())
        return slots

    def reset(self) -> None:
        """Free every tree slot back to the allocator and empty the tree (no locks allowed)."""
        assert self._protected_size == 0, "reset with locked nodes"
        self.allocator.free(self.held_slots())
        self._init_tree()

    # ------------------------------------------------------------- internals

    def peek(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """(matched length, how many of those tokens are on unlocked nodes) for the longest
        cached prefix of ``token_ids``, without splitting a node or marking any as accessed:
        for ordering and admission checks, which must not count as hits."""
        if self.disable or len(token_ids) == 0:
            return 0, 0
        key = token_ids if isinstance(token_ids, list) else list(token_ids)
        node, pos, unlocked = self.root, 0, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched_len = common_prefix_len(key, pos, child.key)
            if child.lock_ref == 0:
                unlocked += matched_len
            pos += matched_len
            if matched_len < len(child.key):
                break
            node = child
        return pos, unlocked

    def _touch(self, node: TreeNode, tick: int) -> None:
        node.last_access_time = tick
        node.access_wall = self._wall
        if node in self._evictable_leaves:
            self._push(node)

    def _push(self, leaf: TreeNode) -> None:
        heapq.heappush(self._heap, (self._priority(leaf), leaf))
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:  # drop stale entries
            self._heap = [(self._priority(n), n) for n in self._evictable_leaves]
            heapq.heapify(self._heap)

    def _add_evictable(self, leaf: TreeNode) -> None:
        self._evictable_leaves.add(leaf)
        self._push(leaf)

    def _tick(self) -> int:
        self._clock += 1
        self._wall = time.monotonic()
        return self._clock

    def _path_len(self, node: TreeNode) -> int:
        length = 0
        while node is not self.root:
            length += len(node.key)
            node = node.parent
        return length

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; return the new upper node."""
        # The upper half lies on every locked path through child, so it inherits
        # the lock count; sizes and the evictable-leaf set are unchanged.
        upper = TreeNode(child.key[:split_len], child.value[:split_len], child.parent,
                         child.last_access_time, child.hit_count, child.lock_ref,
                         child.access_wall)
        upper.subtree_tokens = child.subtree_tokens  # the same tokens, one node more
        child.subtree_tokens -= split_len
        upper.children[child.key[split_len]] = child
        child.parent.children[child.key[0]] = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: list[int], tick: int) -> None:
        leaf = TreeNode(key, value, parent, tick, access_wall=self._wall)
        parent.children[key[0]] = leaf
        up: TreeNode | None = parent
        while up is not None:
            up.subtree_tokens += len(key)
            up = up.parent
        self._evictable_leaves.discard(parent)
        self._add_evictable(leaf)
        self._evictable_size += len(key)
        self._num_nodes += 1

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        up: TreeNode | None = parent
        while up is not None:
            up.subtree_tokens -= len(leaf.key)
            up = up.parent
        self._evictable_leaves.discard(leaf)
        self._evictable_size -= len(leaf.key)
        self._num_nodes -= 1
        leaf.parent = None  # so a stale lock on it fails loudly
        if parent is not self.root and parent.lock_ref == 0 and not parent.children:
            self._add_evictable(parent)

    # ------------------------------------------------------------ inspection

    def check_integrity(self) -> None:
        """Walk the whole tree and assert structure, counters, locks and slot ownership."""
        root = self.root
        _check(not root.key and not root.value and root.parent is None, "malformed root")
        _check(root.lock_ref == 0, "root must not carry a lock count")
        evictable = protected = num_nodes = num_slots = 0
        leaves: set[TreeNode] = set()
        seen_slots: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            children_lock_sum = 0
            below = sum(child.subtree_tokens for child in node.children.values())
            _check(node.subtree_tokens == len(node.key) + below,
                   f"{node!r}: subtree_tokens {node.subtree_tokens} != "
                   f"{len(node.key)} + children's {below}")
            for first, child in node.children.items():
                _check(child.parent is node, f"{child!r} has a wrong parent")
                _check(len(child.key) > 0, f"{child!r} has an empty key")
                _check(len(child.key) == len(child.value), f"{child!r}: key/value lengths")
                _check(child.key[0] == first, f"{child!r} filed under token {first}")
                _check(child.lock_ref >= 0, f"{child!r} has a negative lock_ref")
                children_lock_sum += child.lock_ref
                stack.append(child)
            if node is root:
                continue
            _check(node.lock_ref >= children_lock_sum,
                   f"{node!r} lock_ref below its children's sum {children_lock_sum}")
            num_nodes += 1
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
            num_slots += len(node.value)
            seen_slots.update(node.value)
            for slot in node.value:
                _check(1 <= slot <= self.allocator.size, f"slot {slot} out of range")
                _check(not self.allocator.is_free(slot), f"tree slot {slot} is also free")
        _check(len(seen_slots) == num_slots, "a slot is held by two tree positions")
        _check(evictable == self._evictable_size,
               f"evictable_size {self._evictable_size} != walked {evictable}")
        _check(protected == self._protected_size,
               f"protected_size {self._protected_size} != walked {protected}")
        _check(num_nodes == self._num_nodes, f"num_nodes {self._num_nodes} != walked {num_nodes}")
        _check(root.subtree_tokens == evictable + protected,
               f"root subtree_tokens {root.subtree_tokens} != tree tokens {evictable + protected}")
        _check(leaves == self._evictable_leaves, "evictable-leaf set out of date")
        current = {(key, leaf) for key, leaf in self._heap if leaf in leaves}
        _check(all((self._priority(leaf), leaf) in current for leaf in leaves),
               "an evictable leaf has no heap entry at its current priority")
        _check(self.allocator.num_free_slots + num_slots <= self.allocator.size,
               "free slots + tree slots exceed the pool")

    def pretty(self) -> str:
        """Readable multi-line dump of the tree (tokens truncated)."""
        lines = [f"root (nodes={self._num_nodes}, evictable={self._evictable_size}, "
                 f"protected={self._protected_size}, policy={self.eviction_policy}"
                 f"{', disabled' if self.disable else ''})"]
        stack = [(child, 1) for child in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + _describe(node))
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"RadixCache(nodes={self._num_nodes}, evictable={self._evictable_size}, "
                f"protected={self._protected_size}, policy={self.eviction_policy!r}, "
                f"disable={self.disable})")


def _describe(node: TreeNode) -> str:
    def shorten(run: list[int]) -> str:
        shown = " ".join(map(str, run[:_PRETTY_MAX_TOKENS]))
        extra = len(run) - _PRETTY_MAX_TOKENS
        return f"[{shown}{f' ...+{extra}' if extra > 0 else ''}]"

    return (f"{shorten(node.key)} slots={shorten(node.value)} lock={node.lock_ref} "
            f"t={node.last_access_time} hits={node.hit_count}")
