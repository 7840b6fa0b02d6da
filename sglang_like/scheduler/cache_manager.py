"""KVCacheManager: who owns which KV slot — the radix tree, a running request, or the free list."""

from __future__ import annotations

from collections.abc import Iterable

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.namespace import tree_key
from sglang_like.mem_pool import ReqToTokenPool
from sglang_like.req import Req


class KVCacheManager:
    """Composes the slot allocator, the radix tree and the req_to_token rows.

    Ownership of a running request's row (see Req for the regions):

        [0, cache_protected_len)        tree-owned, locked through req.last_node
        [cache_protected_len, kv_len)   request-owned; freed or handed to the tree on release

    Invariant (checked by `check_accounting`):
        free + evictable + protected + sum(request-owned) == pool size
    """

    def __init__(
        self,
        allocator: KVSlotAllocator,
        tree: RadixCache,
        req_to_token_pool: ReqToTokenPool,
    ) -> None:
        self.allocator = allocator
        self.tree = tree
        self.req_to_token_pool = req_to_token_pool

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_available_slots(self) -> int:
        """Slots that can be had now: free plus evictable."""
        return self.allocator.num_free_slots + self.tree.evictable_size

    @property
    def pool_size(self) -> int:
        return self.allocator.size

    # ---- admission -----------------------------------------------------------------------
    def match_and_lock(self, req: Req, max_prefix_len: int) -> None:
        """Give a row-less request a row and its longest cached prefix (<= max_prefix_len)."""
        assert req.req_pool_idx is None and req.last_node is None
        row = self.req_to_token_pool.alloc()
        assert row is not None, "caller checks num_free_rows first"
        req.req_pool_idx = row
        match = self.tree.match_prefix(tree_key(req.fill_ids[:max_prefix_len],
                                                req.cache_namespace))
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = req.kv_len = len(match.slots)
        self.req_to_token_pool.write(row, 0, match.slots)

    def peek(self, token_ids: list[int], namespace: int | None = None) -> tuple[int, int]:
        """(cached prefix length, how much of it is evictable now) in the request's
        namespace: no hit is counted."""
        return self.tree.peek(tree_key(token_ids, namespace))

    def alloc_slots(self, num_slots: int) -> list[int] | None:
        """Allocate, evicting unlocked tree leaves when the free list is short."""
        short = num_slots - self.allocator.num_free_slots
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(num_slots)

    # ---- after a forward -----------------------------------------------------------------
    def cache_computed_prefix(self, req: Req) -> None:
        """Hand the request's computed tokens to the tree and re-lock them as tree-owned.

        Called after a prefill (or a chunk of one) so that concurrent requests and the later
        samples of an n > 1 request share this prefix at once.
        """
        if self.tree.disable or req.kv_len <= req.cache_protected_len:
            return
        row = req.req_pool_idx
        token_ids = tree_key(req.fill_ids[: req.kv_len], req.cache_namespace)
        slots = self.req_to_token_pool.read(row, 0, req.kv_len)
        cached_len = self.tree.insert(token_ids, slots)
        self.allocator.free(slots[req.cache_protected_len : cached_len])
        match = self.tree.match_prefix(token_ids, count_hit=False)
        assert len(match.slots) == req.kv_len, "prefix just inserted must match in full"
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = req.kv_len
        self.req_to_token_pool.write(row, 0, match.slots)

    def drop_tail(self, req: Req, new_kv_len: int) -> None:
        """Forget computed tokens [new_kv_len, kv_len) (request-owned only): jump-forward."""
        assert req.cache_protected_len <= new_kv_len <= req.kv_len
        slots = self.req_to_token_pool.read(req.req_pool_idx, new_kv_len, req.kv_len)
        self.allocator.free(slots)
        req.kv_len = new_kv_len

    def release(self, req: Req) -> None:
        """A request leaves the running set (finished, aborted or retracted): give its computed
        tokens to the tree (or free them), unlock, and free its row."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        slots = self.req_to_token_pool.read(row, 0, req.kv_len)
        self.tree.insert_and_unlock(tree_key(req.fill_ids[: req.kv_len], req.cache_namespace),
                                    slots, req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.cache_protected_len = 0

    # ---- recovery ------------------------------------------------------------------------
    def reclaim_orphans(self, running: list[Req], held_reqs: list[Req] = (),
                        held_slots: Iterable[int] = ()) -> int:
        """Free every slot that is neither free, nor in the tree, nor in a running request's
        computed row: what a step that failed half-way had allocated. Returns how many.
        `held_reqs` keep their rows and `held_slots` stay allocated (a decode worker's
        transfers in flight)."""
        owned = set(self.tree.held_slots())
        owned.update(held_slots)
        running = [*running, *held_reqs]
        for req in running:
            if req.req_pool_idx is not None:
                owned.update(self.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len))
        is_free = self.allocator.is_free
        orphans = [s for s in range(1, self.allocator.size + 1)
                   if not is_free(s) and s not in owned]
        self.allocator.free(orphans)
        self.req_to_token_pool.reclaim({r.req_pool_idx for r in running
                                        if r.req_pool_idx is not None})
        return len(orphans)

    # ---- checks --------------------------------------------------------------------------
    def num_request_owned(self, running: list[Req]) -> int:
        return sum(r.kv_len - r.cache_protected_len for r in running if r.req_pool_idx is not None)

    def check_accounting(self, running: list[Req], pending_slots: int = 0) -> None:
        """free + evictable + protected + request-owned (+ allocated, not yet written) == size."""
        total = (
            self.allocator.num_free_slots
            + self.tree.evictable_size
            + self.tree.protected_size
            + self.num_request_owned(running)
            + pending_slots
        )
        assert total == self.allocator.size, (
            f"KV accounting broken: free {self.allocator.num_free_slots} + evictable "
            f"{self.tree.evictable_size} + protected {self.tree.protected_size} + owned "
            f"{self.num_request_owned(running)} != {self.allocator.size}"
        )
