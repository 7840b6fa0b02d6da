"""Read-only views of a RadixCache for people: a bounded snapshot of the tree, one node in
full, and the prefix match a token sequence would get. None of them splits a node or counts
as an access, so looking never changes what the scheduler sees.

The snapshot keeps the ``max_nodes`` nodes with the most tokens below them (best-first from
the root, so every kept node's parent is kept too); each kept node says how many children and
tokens were left out beneath it. The tree keeps every node's subtree size, so the cost grows
with the nodes shown (and their children), not with the tree.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from typing import Any

from radix_cache.radix_cache import RadixCache
from radix_cache.tree_node import TreeNode, common_prefix_len

__all__ = ["NODE_FIELDS", "expand", "find_node", "match_view", "node_detail", "snapshot"]

# A node lists at most this many of the requests that hold it (and how many there are).
_MAX_HOLDERS = 8


# The columns of `snapshot(..., rows=True)`; `expand` turns its rows into node dicts.
NODE_FIELDS = ("id", "parent", "start", "tokens", "subtree_tokens", "token_ids", "lock_ref",
               "hit_count", "last_access", "access_wall", "evict_rank", "num_children",
               "hidden_children", "hidden_tokens", "holders", "num_holders")


def snapshot(
    tree: RadixCache,
    *,
    max_nodes: int = 500,
    edge_tokens: int = 32,
    next_evict: int = 16,
    holders: Iterable[tuple[str, TreeNode]] = (),
    rows: bool = False,
) -> dict[str, Any]:
    """The tree as plain data: totals, then nodes in pre-order (the root first).

    ``edge_tokens``: how many leading token ids of each edge to include (the full edge is
    ``node_detail``'s). ``next_evict``: how many leaves to rank in the order ``evict`` would
    take them. ``holders``: (request id, locked last node) of the running requests; each node
    on a request's locked path lists it. ``rows=True``: the nodes as tuples of
    ``NODE_FIELDS`` (cheaper to build and to send; ``expand`` makes the dicts elsewhere).
    """
    if max_nodes < 0 or edge_tokens < 0 or next_evict < 0:
        raise ValueError("max_nodes, edge_tokens and next_evict must be >= 0")
    root = tree.root
    kept: set[TreeNode] | None = None  # None: every node
    if max_nodes < tree.num_nodes:  # best-first by tokens beneath: visits kept nodes' children
        kept = {root}
        frontier = [(-c.subtree_tokens, c.id, c) for c in root.children.values()]
        heapq.heapify(frontier)
        while frontier and len(kept) <= max_nodes:
            _, _, node = heapq.heappop(frontier)
            kept.add(node)
            for child in node.children.values():
                heapq.heappush(frontier, (-child.subtree_tokens, child.id, child))

    held_by = _holders_by_node(tree, holders)
    ranks = {leaf: i + 1 for i, leaf in enumerate(tree.eviction_order(next_evict))}
    table = []
    walk = [(root, 0)]  # pre-order over the kept nodes, children in insertion order
    while walk:
        node, start = walk.pop()
        key = node.key
        end = start + len(key)
        children = node.children
        shown = list(children.values()) if kept is None else [
            c for c in children.values() if c in kept]
        hidden_tokens = node.subtree_tokens - len(key)
        for child in shown:
            hidden_tokens -= child.subtree_tokens
        for child in reversed(shown):
            walk.append((child, end))
        rids = held_by.get(node, ())
        parent = node.parent
        table.append((node.id, None if parent is None else parent.id, start, len(key),
                      node.subtree_tokens, key[:edge_tokens], node.lock_ref, node.hit_count,
                      node.last_access_time, node.access_wall, ranks.get(node),
                      len(children), len(children) - len(shown), hidden_tokens,
                      list(rids[:_MAX_HOLDERS]), len(rids)))
    out = {
        "num_nodes": tree.num_nodes,
        "shown_nodes": len(table) - 1,
        "truncated": len(table) - 1 < tree.num_nodes,
        "total_tokens": tree.total_size,
        "evictable_tokens": tree.evictable_size,
        "locked_tokens": tree.protected_size,
        "evicted_tokens": tree.evicted_tokens,
        "eviction_policy": tree.eviction_policy,
        "disabled": tree.disable,
        "monotonic_time": time.monotonic(),  # when it was taken (idle times count to this)
        "fields": NODE_FIELDS,
        "rows": table,
    }
    return out if rows else expand(out)


def expand(snap: dict[str, Any]) -> dict[str, Any]:
    """A ``rows=True`` snapshot with its rows as node dicts, each with its ``state`` (root /
    locked / evictable) and ``idle_s`` (seconds since last access when it was taken)."""
    out = {k: v for k, v in snap.items() if k not in ("fields", "rows", "monotonic_time")}
    fields, now = snap["fields"], snap["monotonic_time"]
    nodes = []
    for row in snap["rows"]:
        node = dict(zip(fields, row, strict=True))
        wall = node.pop("access_wall")
        node["idle_s"] = round(now - wall, 3) if wall else None
        node["state"] = ("root" if node["parent"] is None
                         else "locked" if node["lock_ref"] else "evictable")
        nodes.append(node)
    out["nodes"] = nodes
    return out


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
