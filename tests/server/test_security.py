"""The HTTP edge's trust boundaries over the fake engine (issue #49): the admin key and what it
alone reaches, tenants' aborts, state changes only by JSON POST, body size, Host and Origin,
keys from a file or the environment, secrets kept out of /get_server_info."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from sglang_like.launch_server import build_parser, server_args_from

USER, OTHER, ADMIN = "user-key", "other-key", "admin-key"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(fake_server_factory: Any) -> Any:
    return fake_server_factory(api_key=USER, extra_api_keys=(OTHER,), admin_api_key=ADMIN,
                               enable_disaggregation_mode_switch=True, step_s=0.01)


ADMIN_ROUTES = [
    ("POST", "/flush_cache", None),
    ("POST", "/switch_disaggregation_mode", {"mode": "decode"}),
    ("GET", "/metrics", None),
    ("GET", "/dashboard", None),
    ("GET", "/dashboard/static/dashboard.js", None),
    ("GET", "/stats", None),
    ("GET", "/cache_tree", None),
    ("GET", "/cache_tree/node/1", None),
    ("POST", "/cache_match", {"text": "hello"}),
]


def test_operator_routes_need_the_admin_key(keyed: Any) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        for method, path, body in ADMIN_ROUTES:
            assert c.request(method, path, json=body).status_code == 401, path
            r = c.request(method, path, json=body, headers=auth(USER))
            assert r.status_code == 403, (path, r.text)
            assert "admin API key" in r.json()["error"]["message"]
            r = c.request(method, path, json=body, headers=auth(ADMIN))
            assert r.status_code not in (401, 403), (path, r.status_code, r.text)
        assert c.post("/flush_cache", headers=auth(ADMIN)).status_code == 200


def test_plain_key_serves_generation_and_admin_key_too(keyed: Any) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    for key in (USER, OTHER, ADMIN):
        r = httpx.post(keyed.url + "/generate", json=body, headers=auth(key), timeout=10)
        assert r.status_code == 200, r.text
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_without_an_admin_key_operator_routes_are_closed_to_plain_keys(
        fake_server_factory: Any) -> None:
    server = fake_server_factory(api_key=USER)
    r = httpx.post(server.url + "/flush_cache", headers=auth(USER))
    assert r.status_code == 403 and "none is configured" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/abort_request", json={"abort_all": True}, headers=auth(USER))
    assert r.status_code == 403 and server.engine.num_abort_all == 0


def test_abort_all_needs_the_admin_key(keyed: Any) -> None:
    r = httpx.post(keyed.url + "/abort_request", json={"abort_all": True}, headers=auth(USER))
    assert r.status_code == 403
    assert keyed.engine.num_abort_all == 0
    r = httpx.post(keyed.url + "/abort_request", json={"abort_all": True}, headers=auth(ADMIN))
    assert r.status_code == 200 and keyed.engine.num_abort_all == 1


def _start_long(url: str, key: str, rid: str) -> threading.Thread:
    body = {"text": "long one", "rid": rid, "sampling_params": {"max_new_tokens": 150}}
    t = threading.Thread(target=lambda: httpx.post(url + "/generate", json=body,
                                                   headers=auth(key), timeout=30))
    t.start()
    return t


def _wait_running(server: Any, rid: str) -> None:
    deadline = time.monotonic() + 10
    while rid not in server.app.state.server.runner.owners:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_tenant_aborts_only_its_own_requests(keyed: Any) -> None:
    t = _start_long(keyed.url, USER, "victim")
    _wait_running(keyed, "victim")
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        # another tenant: as if there were no such request
        r = c.post("/abort_request", json={"rid": "victim"}, headers=auth(OTHER))
        assert r.status_code == 404
        assert "victim" not in keyed.engine.aborted
        # a rid the engine would treat as derived from the victim's (aborting "victim"
        # reaches "victim-1") is refused while it runs, whoever sends it
        r = c.post("/generate", json={"text": "x", "rid": "victim-1"}, headers=auth(OTHER))
        assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
        r = c.post("/abort_request", json={"rid": "victim"}, headers=auth(USER))
        assert r.status_code == 200
    t.join(timeout=30)
    assert "victim" in keyed.engine.aborted


def test_the_operator_aborts_anyones_request(keyed: Any) -> None:
    t = _start_long(keyed.url, USER, "anyone")
    _wait_running(keyed, "anyone")
    r = httpx.post(keyed.url + "/abort_request", json={"rid": "anyone"}, headers=auth(ADMIN))
    assert r.status_code == 200
    t.join(timeout=30)
    assert "anyone" in keyed.engine.aborted


@pytest.mark.parametrize("rid", ["a\nb", "x" * 300])
def test_rids_are_printable_and_bounded(fake_server: Any, rid: str) -> None:
    r = httpx.post(fake_server.url + "/generate", json={"text": "hi", "rid": rid})
    assert r.status_code == 400
    assert not fake_server.engine.calls
    r = httpx.post(fake_server.url + "/abort_request", json={"rid": rid})
    assert r.status_code == 400


def test_role_switch_only_on_a_worker_started_for_it(fake_server_factory: Any) -> None:
    body = {"mode": "decode"}
    closed = fake_server_factory(admin_api_key=ADMIN)
    r = httpx.post(closed.url + "/switch_disaggregation_mode", json=body, headers=auth(ADMIN))
    assert r.status_code == 403 and "--enable-disaggregation-mode-switch" in r.text
    opened = fake_server_factory(admin_api_key=ADMIN, enable_disaggregation_mode_switch=True)
    r = httpx.post(opened.url + "/switch_disaggregation_mode", json=body, headers=auth(ADMIN))
    # past the gate: the fake engine has no PD role to change
    assert r.status_code == 400 and "cannot change" in r.text


def test_state_changes_only_by_post(fake_server: Any) -> None:
    assert httpx.get(fake_server.url + "/flush_cache").status_code == 405
    fake_server.engine.cached_slots = 7
    assert httpx.post(fake_server.url + "/flush_cache").status_code == 200
    assert fake_server.engine.cached_slots == 0


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_post_bodies_must_be_json(fake_server: Any, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(fake_server.url + "/generate", headers=headers,
                   content=b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}')
    assert r.status_code == 415, r.text
    assert not fake_server.engine.calls
    r = httpx.post(fake_server.url + "/abort_request", headers=headers,
                   content=b'{"abort_all": true}')
    assert r.status_code == 415 and fake_server.engine.num_abort_all == 0
    r = httpx.post(fake_server.url + "/generate", json={"text": "hi"})
    assert r.status_code == 200


def test_body_size_limit(fake_server_factory: Any) -> None:
    server = fake_server_factory(max_request_body_bytes=1000)
    big = {"text": "x" * 2000}
    r = httpx.post(server.url + "/generate", json=big)
    assert r.status_code == 413
    # chunked: no Content-Length, the limit is counted as the body arrives
    payload = httpx.Request("POST", "/", json=big).content

    def chunks() -> Any:
        for i in range(0, len(payload), 100):
            yield payload[i:i + 100]

    r = httpx.post(server.url + "/generate", content=chunks(),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert not server.engine.calls
    assert httpx.post(server.url + "/generate", json={"text": "fits"}).status_code == 200


def test_host_and_origin_against_dns_rebinding(fake_server_factory: Any) -> None:
    server = fake_server_factory()
    port = server.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        # a page of evil.example whose name now resolves to 127.0.0.1 sends its own Host
        r = c.post("/flush_cache", headers={"Host": f"evil.example:{port}"})
        assert r.status_code == 421
        r = c.get("/get_server_info", headers={"Host": "evil.example"})
        assert r.status_code == 421
        assert c.get("/get_model_info", headers={"Host": f"localhost:{port}"}).status_code == 200
        # a cross-site page posting to the loopback server: its Origin gives it away
        server.engine.cached_slots = 5
        r = c.post("/flush_cache", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and server.engine.cached_slots == 5
        r = c.post("/flush_cache", headers={"Origin": f"http://127.0.0.1:{port}"})
        assert r.status_code == 200
    anyhost = fake_server_factory(allowed_hosts=("*",))
    r = httpx.get(anyhost.url + "/get_model_info", headers={"Host": "a.example"})
    assert r.status_code == 200
    named = fake_server_factory(allowed_hosts=("llm.internal",))
    assert httpx.get(named.url + "/get_model_info").status_code == 421
    r = httpx.get(named.url + "/get_model_info", headers={"Host": "llm.internal:80"})
    assert r.status_code == 200


def test_server_info_shows_no_secret(fake_server_factory: Any) -> None:
    server = fake_server_factory(api_key=USER, admin_api_key=ADMIN, extra_api_keys=(OTHER,),
                                 disaggregation_secret="pd-secret", ssl_keyfile="/k.pem")
    text = httpx.get(server.url + "/get_server_info", headers=auth(USER)).text
    for secret in (USER, ADMIN, OTHER, "pd-secret", "/k.pem"):
        assert secret not in text


def test_keys_from_a_file_or_the_environment(tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nalpha\n\nbeta\n")
    keys.chmod(0o600)
    admin = tmp_path / "admin"
    admin.write_text("root-key\n")
    admin.chmod(0o600)
    ns = build_parser().parse_args(["--api-key-file", str(keys),
                                    "--admin-api-key-file", str(admin)])
    args = server_args_from(ns, environ={})
    assert (args.api_key, args.extra_api_keys, args.admin_api_key) == (
        "alpha", ("beta",), "root-key")
    env = {"SGLANG_LIKE_API_KEY": "e1", "SGLANG_LIKE_ADMIN_API_KEY": "e2",
           "SGLANG_LIKE_DISAGGREGATION_SECRET": "e3"}
    args = server_args_from(build_parser().parse_args([]), environ=env)
    assert (args.api_key, args.admin_api_key, args.disaggregation_secret) == ("e1", "e2", "e3")
    with pytest.raises(SystemExit, match="differ"):
        server_args_from(build_parser().parse_args(["--api-key", "same"]),
                         environ={"SGLANG_LIKE_ADMIN_API_KEY": "same"})


def test_router_launcher_keeps_keys_off_command_lines() -> None:
    from sglang_like import launch_router

    argv, env, key = launch_router.replica_secrets(
        ["--api-key", "k1", "--admin-api-key=k2", "--max-total-tokens", "64"], pd=True)
    assert argv == ["--max-total-tokens", "64"]
    assert env["SGLANG_LIKE_API_KEY"] == "k1" and env["SGLANG_LIKE_ADMIN_API_KEY"] == "k2"
    assert len(env["SGLANG_LIKE_DISAGGREGATION_SECRET"]) == 64 and key == "k1"
    ns = launch_router.build_parser().parse_args([])
    cmd = launch_router.router_command(ns, ["http://127.0.0.1:1"], 2, key)
    assert "k1" not in " ".join(cmd)
    assert launch_router.router_env(key)["SGLANG_LIKE_ROUTER_API_KEY"] == "k1"


def test_a_500_does_not_carry_the_exception_text(fake_server: Any, caplog: Any) -> None:
    def broken() -> dict:
        raise RuntimeError("/home/someone/secret-path and a peer's prompt")

    fake_server.engine.get_load = broken
    r = httpx.get(fake_server.url + "/get_load")
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "secret-path" not in r.text and "RuntimeError" not in r.text
    assert "id " in message


def test_role_switch_drain_is_bounded(fake_server_factory: Any) -> None:
    server = fake_server_factory(enable_disaggregation_mode_switch=True)
    r = httpx.post(server.url + "/switch_disaggregation_mode",
                   json={"mode": "decode", "drain_timeout": 3600})
    assert r.status_code == 400 and "drain_timeout" in r.text
