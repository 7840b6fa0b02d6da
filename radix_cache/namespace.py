"""Tenants' namespaces in the radix tree: requests of different cache salts share no prefix.

A namespaced key differs from the plain token ids in its first token only: a negative id
that encodes (namespace, token). Paths of different namespaces therefore part at the root,
so no node, hit or `cached_tokens` count is ever shared between them; the tree itself needs
no change, and a key still fits int64 (snapshots cross a msgspec pipe).
"""

from __future__ import annotations

import hashlib

__all__ = ["adapter_namespace", "cache_namespace", "tree_key", "token_namespace", "untag_token"]

_NAMESPACE_BITS = 30
_TOKEN_BITS = 32


def cache_namespace(salt: str | None) -> int | None:
    """The radix-tree namespace of a cache salt (None: the shared one)."""
    if not salt:
        return None
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _NAMESPACE_BITS)


def adapter_namespace(namespace: int | None, adapter_uid: int) -> int:
    """The namespace of a request on LoRA adapter load `adapter_uid` within a tenant's
    `namespace`: KV computed with an adapter's weights is never another adapter's (or the
    base model's), and a reload of the same name starts afresh."""
    return cache_namespace(f"lora:{adapter_uid}:{namespace}")  # type: ignore[return-value]


def tree_key(token_ids: list[int], namespace: int | None) -> list[int]:
    """The tree's key for a request's tokens. A namespaced key's first token is a negative
    id that encodes (namespace, token): paths of different namespaces part at the root, so
    no node, hit or `cached_tokens` count is ever shared between tenants, and a key still fits
    int64 (the dashboard's snapshots cross a msgspec pipe)."""
    if namespace is None or not token_ids:
        return token_ids
    return [-1 - ((namespace << _TOKEN_BITS) | token_ids[0]), *token_ids[1:]]


def untag_token(token: int) -> int:
    """The token id a tree key's first token stands for (itself unless namespaced)."""
    return token if token >= 0 else (-1 - token) & ((1 << _TOKEN_BITS) - 1)


def token_namespace(token: int) -> int | None:
    """The namespace a tree key's first token carries (None: the shared one)."""
    return None if token >= 0 else (-1 - token) >> _TOKEN_BITS
