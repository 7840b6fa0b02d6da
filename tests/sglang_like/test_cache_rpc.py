"""EngineCore's dashboard RPCs on a real radix tree (the scheduler around it stubbed): the
snapshot budget (a fresh walk at most once per 100x its cost), `known_id`, busy-time
accounting, and the prefix match the scheduler would reuse."""

from __future__ import annotations

import types

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.snapshot import expand
from sglang_like.engine_core import core as core_mod
from sglang_like.engine_core.core import EngineCore


def _core(tree: RadixCache) -> EngineCore:
    core = EngineCore.__new__(EngineCore)  # no model: only what the RPCs read
    core.scheduler = types.SimpleNamespace(cache=types.SimpleNamespace(tree=tree), running=[],
                                           lora_namespaces={})
    core._snapshots = {}
    core._next_snapshot_at = 0.0
    core._snapshot_ids = 0
    core.dashboard_busy_s = 0.0
    return core


def _tree() -> RadixCache:
    tree = RadixCache(KVSlotAllocator(64))
    for seq in ([1, 2, 3, 4], [1, 2, 5]):
        slots = tree.allocator.alloc(len(seq))
        tree.allocator.free(slots[:tree.insert(seq, slots)])
    return tree


def test_snapshot_budget_and_known_id(monkeypatch):
    tree = _tree()
    core = _core(tree)
    monkeypatch.setattr(core_mod, "SNAPSHOT_DUTY", 1e-9)  # the last walk stays good "forever"
    first = core.cache_tree(max_nodes=10)
    assert first["snapshot_id"] == 1 and first["snapshot_ms"] >= 0 and first["taken_at"] > 0
    assert [n["tokens"] for n in expand(first)["nodes"]] == [0, 2, 2, 1]
    slots = tree.allocator.alloc(2)
    tree.insert([9, 9], slots)  # the tree changes, but the budget is spent: the same snapshot
    assert core.cache_tree(max_nodes=10)["snapshot_id"] == 1
    assert core.cache_tree(max_nodes=10, known_id=1) == {"snapshot_id": 1, "unchanged": True}
    # other parameters: the budget is the same one (alternating parameters must not buy
    # fresh walks), so they are told how long to wait
    wait = core.cache_tree(max_nodes=3)
    assert set(wait) == {"retry_after"} and wait["retry_after"] > 0
    core._next_snapshot_at = 0.0  # the budget is back
    other = core.cache_tree(max_nodes=3)
    assert other["snapshot_id"] == 2 and other["num_nodes"] == 4
    # while the budget is spent again, each parameters' last snapshot answers
    assert core.cache_tree(max_nodes=10)["snapshot_id"] == 1
    assert core.cache_tree(max_nodes=3)["snapshot_id"] == 2
    monkeypatch.setattr(core_mod, "SNAPSHOT_DUTY", 1e9)  # no budget to wait for: always fresh
    core._next_snapshot_at = 0.0
    again = core.cache_tree(max_nodes=3, known_id=2)
    assert again["snapshot_id"] == 3 and "unchanged" not in again
    assert core.dashboard_busy_s > 0


def test_cache_match_caps_what_a_request_reuses():
    core = _core(_tree())
    view = core.cache_match([1, 2, 3, 4])
    assert view["matched_tokens"] == 4 and view["reusable_tokens"] == 3  # one token must run
    assert core.cache_match([1, 2, 5, 7])["reusable_tokens"] == 3
    assert core.cache_match([8])["reusable_tokens"] == 0
    assert core.cache_match([])["reusable_tokens"] == 0
