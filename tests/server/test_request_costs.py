"""What one request may cost (issue #49), over the fake engine: stop lists capped on every
route, text measured before it is tokenized, the queue limit counting a request's whole
fan-out, a batch with one bad prompt failing whole, and HTTPS when asked for."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from sglang_like.config import ServerArgs
from sglang_like.launch_server import uvicorn_config
from sglang_like.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20)


@pytest.mark.parametrize("sampling", [
    {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
    {"stop": ["x" * 5000]},
    {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
])
def test_native_stop_lists_are_capped(fake_server: Any, sampling: dict) -> None:
    r = _post(fake_server.url, "/generate", {"text": "hi", "sampling_params": sampling})
    assert r.status_code == 400, r.text
    assert not fake_server.engine.calls


def test_openai_stop_ids_are_capped_and_caps_are_not_too_tight(fake_server: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 1,
            "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}
    assert _post(fake_server.url, "/v1/completions", body).status_code == 400
    assert not fake_server.engine.calls
    body = {"prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
            "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]}
    assert _post(fake_server.url, "/v1/completions", body).status_code == 200
    sampling = {"max_new_tokens": 1, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]}
    assert _post(fake_server.url, "/generate",
                 {"text": "hi", "sampling_params": sampling}).status_code == 200


def test_text_is_measured_before_tokenizing(fake_server_factory: Any) -> None:
    server = fake_server_factory(max_prompt_chars=100)
    long = "y" * 101
    cases = [
        ("/generate", {"text": long}),
        ("/generate", {"text": ["ok", long]}),
        ("/v1/completions", {"prompt": [long], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 60},
                                               {"role": "user", "content": "z" * 60}]}),
        ("/tokenize", {"prompt": long}),
    ]
    for path, body in cases:
        r = _post(server.url, path, body)
        assert r.status_code == 400 and "--max-prompt-chars" in r.text, (path, r.text)
    assert not server.engine.calls
    assert _post(server.url, "/generate", {"text": "y" * 100,
                                           "sampling_params": {"max_new_tokens": 1}}
                 ).status_code == 200


def test_queue_limit_counts_the_whole_fan_out(fake_server_factory: Any) -> None:
    server = fake_server_factory(max_running_requests=1, max_queued_requests=4)
    # 3 prompts x n=2: 6 requests, of which 1 runs and 5 would wait
    body = {"text": ["a", "b", "c"], "sampling_params": {"n": 2, "max_new_tokens": 1}}
    r = _post(server.url, "/generate", body)
    assert r.status_code == 429, r.text
    body = {"prompt": ["a", "b"], "n": 3, "max_tokens": 1, "stream": True}
    r = _post(server.url, "/v1/completions", body)
    assert r.status_code == 429, r.text
    assert not server.engine.calls
    # 5 fit: 1 runs, 4 wait
    body = {"text": ["a", "b", "c", "d", "e"], "sampling_params": {"max_new_tokens": 1}}
    assert _post(server.url, "/generate", body).status_code == 200


def test_a_batch_with_one_bad_prompt_fails_whole(fake_server_factory: Any) -> None:
    server = fake_server_factory(step_s=0.05)
    engine = server.engine
    # the second prompt is longer than the fake's context (256): the engine refuses it
    body = {"prompt": ["a good prompt", "x" * 300], "max_tokens": 50}
    t0 = time.monotonic()
    r = _post(server.url, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert time.monotonic() - t0 < 2  # not after the good prompt's 50 tokens
    good = next(c["rid"] for c in engine.calls if c["prompt"] == "a good prompt")
    deadline = time.monotonic() + 5
    while good not in engine.aborted or engine.used_slots:
        assert time.monotonic() < deadline, "the good prompt ran on, detached"
        time.sleep(0.01)


@pytest.fixture
def cert(tmp_path: Any) -> tuple[str, str]:
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(key), str(crt)


def test_https_with_a_key_and_certificate(cert: tuple[str, str]) -> None:
    from fake_engine import FakeEngine

    from sglang_like.server import create_app

    port = _free_port()
    args = ServerArgs(port=port, log_level="warning", ssl_keyfile=cert[0], ssl_certfile=cert[1])
    server = uvicorn.Server(uvicorn_config(create_app(FakeEngine()), args, 1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        trust = ssl.create_default_context(cafile=cert[1])
        r = httpx.get(f"https://127.0.0.1:{port}/health", verify=trust)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
