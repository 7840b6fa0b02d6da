"""Read-only views of a RadixCache for people: a bounded snapshot of the tree, one node in
full, and the prefix match a token sequence would get. None of them splits a node or counts
as an access, so looking never changes what the scheduler sees.

The snapshot keeps the ``max_nodes`` nodes with the most tokens below them (best-first from
the root, so every kept node's parent is kept too); each kept node says how many children and
tokens were left out beneath it. One walk of the whole tree computes the subtree sizes.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from typing import Any

from radix_cache.radix_cache import RadixCache
from radix_cache.tree_node import TreeNode, common_prefix_len

__all__ = ["find_node", "match_view", "node_detail", "snapshot"]

# A node lists at most this many of the requests that hold it (and how many there are).
_MAX_HOLDERS = 8


def snapshot(
    tree: RadixCache,
    *,
    max_nodes: int = 500,
    edge_tokens: int = 32,
    next_evict: int = 16,
    holders: Iterable[tuple[str, TreeNode]] = (),
) -> dict[str, Any]:
    """The tree as plain data: totals, then nodes in pre-order (the root first).

    ``edge_tokens``: how many leading token ids of each edge to include (the full edge is
    ``node_detail``'s). ``next_evict``: how many leaves to rank in the order ``evict`` would
    take them. ``holders``: (request id, locked last node) of the running requests; each node
    on a request's locked path lists it.
    """
    if max_nodes < 0 or edge_tokens < 0 or next_evict < 0:
        raise ValueError("max_nodes, edge_tokens and next_evict must be >= 0")
    root = tree.root
    order: list[TreeNode] = []  # pre-order, children in insertion order
    stack = [root]
    while stack:
        node = stack.pop()
        order.append(node)
        if node.children:
            stack.extend(reversed(node.children.values()))
    subtree: dict[TreeNode, int] = {}
    for node in reversed(order):
        size = len(node.key)
        for child in node.children.values():
            size += subtree[child]
        subtree[node] = size

    kept = {root}
    frontier = [(-subtree[c], c.id, c) for c in root.children.values()]
    heapq.heapify(frontier)
    while frontier and len(kept) <= max_nodes:
        _, _, node = heapq.heappop(frontier)
        kept.add(node)
        for child in node.children.values():
            heapq.heappush(frontier, (-subtree[child], child.id, child))

    held_by = _holders_by_node(tree, holders)
    ranks = {leaf: i + 1 for i, leaf in enumerate(tree.eviction_order(next_evict))}
    now = time.monotonic()
    nodes = []
    walk = [(root, 0)]  # pre-order over the kept nodes only
    while walk:
        node, start = walk.pop()
        end = start + len(node.key)
        shown = [c for c in node.children.values() if c in kept]
        walk.extend((c, end) for c in reversed(shown))
        rids = held_by.get(node, [])
        nodes.append({
            "id": node.id,
            "parent": None if node is root else node.parent.id,
            "start": start,
            "tokens": len(node.key),
            "subtree_tokens": subtree[node],
            "token_ids": node.key[:edge_tokens],
            "state": "locked" if node.lock_ref else "evictable",
            "lock_ref": node.lock_ref,
            "hit_count": node.hit_count,
            "last_access": node.last_access_time,
            "idle_s": round(now - node.access_wall, 3) if node.access_wall else None,
            "evict_rank": ranks.get(node),
            "num_children": len(node.children),
            "hidden_children": len(node.children) - len(shown),
            "hidden_tokens": subtree[node] - len(node.key) - sum(subtree[c] for c in shown),
            "holders": rids[:_MAX_HOLDERS],
            "num_holders": len(rids),
        })
    nodes[0]["state"] = "root"
    return {
        "num_nodes": tree.num_nodes,
        "shown_nodes": len(nodes) - 1,
        "truncated": len(nodes) - 1 < tree.num_nodes,
        "total_tokens": tree.total_size,
        "evictable_tokens": tree.evictable_size,
        "locked_tokens": tree.protected_size,
        "evicted_tokens": tree.evicted_tokens,
        "eviction_policy": tree.eviction_policy,
        "disabled": tree.disable,
        "nodes": nodes,
    }


def find_node(tree: RadixCache, node_id: int) -> TreeNode | None:
    """The node with this id, or None (ids are unique for the life of the process)."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        if node.id == node_id:
            return node
        stack.extend(node.children.values())
    return None


def node_detail(tree: RadixCache, node_id: int,
                holders: Iterable[tuple[str, TreeNode]] = ()) -> dict[str, Any] | None:
    """One node in full: its edge's token ids, the whole prefix from the root, and every
    request that holds it. None when no such node is in the tree (evicted, or never was)."""
    node = find_node(tree, node_id)
    if node is None:
        return None
    path = []
    up = node
    while up is not None:
        path.append(up)
        up = up.parent
    path.reverse()
    prefix = [t for n in path for t in n.key]
    held = _holders_by_node(tree, holders).get(node, [])
    return {
        "id": node.id,
        "parent": None if node.parent is None else node.parent.id,
        "path": [n.id for n in path],
        "start": len(prefix) - len(node.key),
        "tokens": len(node.key),
        "token_ids": list(node.key),
        "prefix_token_ids": prefix,
        "state": "root" if node is tree.root else ("locked" if node.lock_ref else "evictable"),
        "lock_ref": node.lock_ref,
        "hit_count": node.hit_count,
        "last_access": node.last_access_time,
        "idle_s": round(time.monotonic() - node.access_wall, 3) if node.access_wall else None,
        "num_children": len(node.children),
        "holders": held,
    }


def match_view(tree: RadixCache, token_ids: Sequence[int]) -> dict[str, Any]:
    """How much of ``token_ids`` the tree holds and where the match ends, as ``match_prefix``
    would find it, without splitting the last node or counting a hit.

    ``path``: the nodes the match passes through with how many of each node's tokens match;
    the last one may match only part of its edge (``ends_inside``), where ``match_prefix``
    would split it.
    """
    key = list(token_ids)
    path: list[dict[str, int]] = []
    node, pos = tree.root, 0
    ends_inside = False
    while not tree.disable and pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            break
        matched = common_prefix_len(key, pos, child.key)
        path.append({"id": child.id, "tokens": len(child.key), "matched": matched})
        pos += matched
        if matched < len(child.key):
            ends_inside = True
            break
        node = child
    return {"num_tokens": len(key), "matched_tokens": pos, "ends_inside": ends_inside,
            "path": path}


def _holders_by_node(tree: RadixCache,
                     holders: Iterable[tuple[str, TreeNode]]) -> dict[TreeNode, list[str]]:
    out: dict[TreeNode, list[str]] = {}
    root = tree.root
    for rid, last in holders:
        node = last
        while node is not None and node is not root:
            out.setdefault(node, []).append(rid)
            node = node.parent
    return out
