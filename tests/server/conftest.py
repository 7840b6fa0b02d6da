"""Fixtures: an in-thread uvicorn over the fake engine (HTTP-layer unit tests), and a real server
subprocess with the default model (the proof), shared by the real-model test files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from sglang_like.server import create_app

sys.path.insert(0, os.path.dirname(__file__))
from fake_engine import FakeEngine  # noqa: E402

_STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeServer:
    url: str
    engine: FakeEngine
    app: Any


@pytest.fixture
def fake_server_factory() -> Iterator[Any]:
    """Start uvicorn in a thread over a FakeEngine; stopped at teardown."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**engine_kwargs: Any) -> FakeServer:
        engine = FakeEngine(**engine_kwargs)
        app = create_app(engine)
        port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        servers.append((server, thread))
        return FakeServer(f"http://127.0.0.1:{port}", engine, app)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def fake_server(fake_server_factory: Any) -> FakeServer:
    return fake_server_factory()


# ---- the real server ----------------------------------------------------------------------
@dataclass
class RealServer:
    url: str
    proc: subprocess.Popen
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def start_real_server(*extra_args: str, api_key: str | None = None,
                      new_session: bool = False, env: dict[str, str] | None = None) -> RealServer:
    """`python -m sglang_like.launch_server` on a free loopback port; waits for /health.

    `new_session`: the server leads its own process group, so a test can kill it together
    with its children (the engine process) by `os.killpg`. `env`: variables set for it."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
           "--log-level", "warning", *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session,
                            env={**os.environ, **env} if env else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not become healthy in time")
        time.sleep(0.25)
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    return RealServer(url, proc, api_key)


def stop_real_server(server: RealServer, timeout: float = 60.0) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


def _drain(proc: subprocess.Popen) -> None:
    """Keep reading the server's output so a full pipe never blocks it."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def _launcher(stop_timeout: float) -> Iterator[Any]:
    """`start(*cli_args, api_key=...)` real servers; any still running are stopped after."""
    started: list[RealServer] = []

    def start(*args: str, api_key: str | None = None,
              env: dict[str, str] | None = None) -> RealServer:
        server = start_real_server(*args, api_key=api_key, env=env)
        started.append(server)
        return server

    start.stop = stop_real_server  # type: ignore[attr-defined]
    yield start
    for server in started:
        stop_real_server(server, timeout=stop_timeout)


@pytest.fixture
def server_launcher() -> Iterator[Any]:
    """Real servers for one test, stopped at its teardown."""
    yield from _launcher(stop_timeout=10)


@pytest.fixture(scope="module")
def module_server_launcher() -> Iterator[Any]:
    """`server_launcher` for a module's own fixtures: servers live until the module ends."""
    yield from _launcher(stop_timeout=60)


@pytest.fixture(scope="session")
def real_server() -> Iterator[RealServer]:
    """One server with the default model, shared by the real-model tests of this folder."""
    server = start_real_server("--max-running-requests", "32")
    yield server
    stop_real_server(server)
