"""A fake `/generate`-shaped backend that records every body it is sent (unit tests only)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from frontend_dsl.backends.base import NativeBackend
from frontend_dsl.chat_template import template_from_jinja

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _char_logprob(before: str, ch: str) -> float:
    """Conditional score of one character-token: 'a' -1, a first 'b' -0.5, a repeated 'b' -3."""
    if ch == "a":
        return -1.0
    if ch == "b":
        return -3.0 if before.endswith("b") else -0.5
    return -2.0


_UNCONDITIONAL = {"a": -0.1, "b": -3.0}


class FakeBackend(NativeBackend):
    """Tokenizes by characters (token id = ord). Generation returns `reply(prompt, params)`.

    Records every body in `.bodies` (in arrival order) and tracks peak concurrency.
    """

    def __init__(self, reply: Callable[[str, dict], str] | None = None, delay_s: float = 0.0,
                 template: str | None = SMOL_TEMPLATE) -> None:
        self.chat_template = template_from_jinja(template)
        self.reply = reply or (lambda prompt, sp: f"<{len(prompt)}>")
        self.delay_s = delay_s
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def _one(self, text: str | None, ids: list[int] | None, body: dict) -> dict[str, Any]:
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            sp = sp[0]
        text = text if text is not None else "".join(chr(i) for i in ids)
        meta: dict[str, Any] = {"prompt_tokens": len(text), "completion_tokens": 0}
        out = "" if sp.get("max_new_tokens") == 0 else self.reply(text, sp)
        meta["completion_tokens"] = len(out)
        if body.get("return_logprob"):
            start = max(body.get("logprob_start_len", 0), 0)
            table = (lambda b, c: _UNCONDITIONAL.get(c, -2.0)) if ids is not None else (
                _char_logprob)
            meta["input_token_logprobs"] = [
                [None if i == 0 else table(text[:i], text[i]), ord(text[i]),
                 text[i] if body.get("return_text_in_logprobs") else None]
                for i in range(start, len(text))
            ]
        return {"text": out, "meta_info": meta}

    def _request(self, body: dict[str, Any]) -> Any:
        with self._lock:
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if isinstance(body.get("text"), list):
                return [self._one(t, None, body) for t in body["text"]]
            if body.get("input_ids") and isinstance(body["input_ids"][0], list):
                return [self._one(None, ids, body) for ids in body["input_ids"]]
            return self._one(body.get("text"), body.get("input_ids"), body)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._lock:
            self.bodies.append(body)
        full = self.reply(body["text"], body["sampling_params"])
        for i in range(0, len(full), 2):
            time.sleep(self.delay_s)
            yield {"text": full[i:i + 2], "meta_info": {"completion_tokens": i + 2}}

    @property
    def generate_bodies(self) -> list[dict[str, Any]]:
        return [b for b in self.bodies if b["sampling_params"].get("max_new_tokens") != 0]


@pytest.fixture
def fake() -> Callable[..., FakeBackend]:
    return FakeBackend


@pytest.fixture
def smol_template() -> str:
    return SMOL_TEMPLATE


# ---- real model, shared by the end-to-end and example tests (built on first use) ----------
@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    from sglang_like.engine import Engine

    eng = Engine(max_total_tokens=16384)
    yield eng
    eng.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_like.launch_server", "--host", "127.0.0.1",
         "--port", str(port), "--max-total-tokens", "16384", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError("server did not become healthy in 240 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
