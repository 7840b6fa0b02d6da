"""Tenants over the fake engine (issue #49): each API key, and each request's vLLM-style
`cache_salt`, is a namespace of the prefix cache; `cached_tokens` never counts another
tenant's prefix unless the operator lets tenants share (--enable-cross-tenant-cache)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

USER, OTHER, ADMIN = "user-key", "other-key", "admin-key"
PROMPT = "the same long system prompt, sent by everyone"


def _generate(url: str, key: str | None, **extra: Any) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, **extra}
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _cached(url: str, key: str | None, **extra: Any) -> int:
    return _generate(url, key, **extra)["cached_tokens"]


@pytest.fixture
def keyed(fake_server_factory: Any) -> Any:
    return fake_server_factory(api_key=USER, extra_api_keys=(OTHER,), admin_api_key=ADMIN)


def test_keys_do_not_share_cached_prefixes(keyed: Any) -> None:
    assert _cached(keyed.url, USER) == 0
    assert _cached(keyed.url, USER) > 0  # its own prefix: a hit
    assert _cached(keyed.url, OTHER) == 0  # another key's: never told
    assert _cached(keyed.url, ADMIN) == 0
    salts = {c["cache_salt"] for c in keyed.engine.calls}
    assert len(salts) == 3
    assert not any(k in s for s in salts for k in (USER, OTHER, ADMIN))  # digests, not keys


def test_cache_salt_separates_requests_of_one_key(keyed: Any) -> None:
    assert _cached(keyed.url, USER, cache_salt="alice") == 0
    assert _cached(keyed.url, USER, cache_salt="bob") == 0
    assert _cached(keyed.url, USER, cache_salt="alice") > 0
    assert _cached(keyed.url, USER) == 0
    # a salt cannot reach into another key's namespace
    assert _cached(keyed.url, OTHER, cache_salt="alice") == 0


def test_cache_salt_on_a_server_without_keys(fake_server: Any) -> None:
    assert _cached(fake_server.url, None) == 0
    assert _cached(fake_server.url, None) > 0  # no keys, no salt: one shared cache, as before
    assert _cached(fake_server.url, None, cache_salt="private") == 0


def test_openai_routes_carry_the_salt(keyed: Any) -> None:
    auth = {"Authorization": f"Bearer {USER}"}
    body = {"prompt": PROMPT, "max_tokens": 2, "cache_salt": "s1"}
    r = httpx.post(keyed.url + "/v1/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "cache_salt": "s1", "stream": True}
    r = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    salts = [c["cache_salt"] for c in keyed.engine.calls]
    assert len(salts) == 2 and all(s and s.endswith("salt:s1") for s in salts)
    for bad in ("", "x" * 300, 5):
        r = httpx.post(keyed.url + "/v1/completions", headers=auth,
                       json={"prompt": "p", "max_tokens": 1, "cache_salt": bad})
        assert r.status_code == 400, (bad, r.text)


def test_operator_may_let_tenants_share(fake_server_factory: Any) -> None:
    server = fake_server_factory(api_key=USER, extra_api_keys=(OTHER,),
                                 enable_cross_tenant_cache=True)
    assert _cached(server.url, USER) == 0
    assert _cached(server.url, OTHER) > 0
    # an explicit salt still isolates
    assert _cached(server.url, OTHER, cache_salt="mine") == 0


def test_dashboard_reads_a_tenants_edges_as_tokens() -> None:
    from radix_cache.namespace import cache_namespace, tree_key
    from sglang_like.server.dashboard.routes import _untag

    node = {"token_ids": tree_key([72, 105], cache_namespace("key:abc")),
            "prefix_token_ids": [72, 105]}
    _untag(node, {}, "token_ids", "prefix_token_ids")
    assert node == {"token_ids": [72, 105], "prefix_token_ids": [72, 105],
                    "tenant_namespace": True}
    plain = {"token_ids": [1, 2]}
    _untag(plain, {}, "token_ids")
    assert plain == {"token_ids": [1, 2]}
    # a LoRA adapter's branch is labelled with the adapter the engine says owns the namespace
    from radix_cache.namespace import adapter_namespace

    ns = adapter_namespace(None, 7)
    branch = {"token_ids": tree_key([5, 6], ns)}
    _untag(branch, {str(ns): "json-style"}, "token_ids")
    assert branch == {"token_ids": [5, 6], "tenant_namespace": True, "lora_adapter": "json-style"}
