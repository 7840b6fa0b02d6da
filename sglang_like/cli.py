"""`sglang-like chat`: a streamed conversation in the terminal, on an Engine in this process
or on a running server."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

_CHAT_HELP = """commands:
  /bye     quit (Ctrl-D too)
  /clear   forget the conversation so far
  /stats   the last reply's token counts (its prompt holds the whole conversation)
  /help    this list
Ctrl-C stops a reply and leaves that turn out of the conversation."""


class TurnStats(NamedTuple):
    """One finished reply: its prompt (the conversation so far) and its own length."""

    prompt_tokens: int
    completion_tokens: int
    seconds: float


class ChatRefused(Exception):
    """The engine or server refused a turn (too long, a bad value): the chat goes on."""


class EngineChat:
    """Turns on an Engine in this process, through the model's chat template."""

    def __init__(self, engine: Any, params: dict[str, Any]) -> None:
        self.engine, self.params = engine, params
        self.name = os.path.basename(engine.model_config.model_path or "the model")
        self.last_stats: TurnStats | None = None

    def stream(self, messages: list[dict]) -> Iterator[str]:
        t0, last = time.perf_counter(), None
        try:  # the engine's stream aborts its request when closed early (Ctrl-C)
            for last in self.engine.chat(messages, self.params, stream=True):
                if last["text"]:
                    yield last["text"]
        except ValueError as exc:  # too long for the context, ...
            raise ChatRefused(str(exc)) from None
        assert last is not None
        meta = last["meta_info"]
        if (finish := meta["finish_reason"]) and finish.get("type") == "abort":
            raise ChatRefused(f"the reply was aborted: {finish.get('message')}")
        self.last_stats = TurnStats(meta["prompt_tokens"], meta["completion_tokens"],
                                    time.perf_counter() - t0)


class HttpChat:
    """Turns on a running server, through its /v1/chat/completions stream."""

    def __init__(self, url: str, api_key: str | None, params: dict[str, Any]) -> None:
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, not {url!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no read timeout: a long reply's tokens may be far apart on a busy server
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                   timeout=httpx.Timeout(30.0, read=None))
        self.params = params
        self.last_stats: TurnStats | None = None
        try:
            resp = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            self.client.close()
            raise ValueError(f"cannot reach the server at {url}: {exc}") from None
        if resp.status_code != 200:
            self.client.close()
            raise ValueError(f"the server at {url} answered /v1/models with "
                             f"{resp.status_code}: {_error_text(resp)}")
        self.name = resp.json()["data"][0]["id"]

    def stream(self, messages: list[dict]) -> Iterator[str]:
        import httpx

        body = {"messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.params}
        t0, usage = time.perf_counter(), None
        try:  # leaving the `with` early closes the connection: the server aborts the reply
            with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ChatRefused(f"{resp.status_code}: {_error_text(resp)}")
                for line in resp.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise ChatRefused(event["error"].get("message", str(event["error"])))
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or ():
                        if text := choice["delta"].get("content"):
                            yield text
        except httpx.HTTPError as exc:
            raise ChatRefused(f"the server: {exc}") from None
        if usage is None:
            raise ChatRefused("the server's stream ended without its usage")
        self.last_stats = TurnStats(usage["prompt_tokens"], usage["completion_tokens"],
                                    time.perf_counter() - t0)

    def close(self) -> None:
        self.client.close()


def _error_text(resp: Any) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text[:500]


def _reply(backend: Any, messages: list[dict]) -> str | None:
    """Stream one reply to the terminal; None when it was stopped or refused."""
    pieces: list[str] = []
    stream = backend.stream(messages)
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces.append(piece)
    except KeyboardInterrupt:
        print("\n(stopped)", flush=True)
        return None
    except ChatRefused as exc:
        print(("\n" if pieces else "") + f"error: {exc}", flush=True)
        return None
    finally:
        stream.close()
    print(flush=True)
    return "".join(pieces)


def _chat_command(line: str, backend: Any, history: list[dict]) -> bool:
    """Run a /command; True means quit."""
    cmd = line.split()[0]
    if cmd in ("/bye", "/exit"):
        return True
    if cmd == "/clear":
        history.clear()
        print("Cleared the conversation.")
    elif cmd in ("/help", "/?"):
        print(_CHAT_HELP)
    elif cmd == "/stats":
        s = backend.last_stats
        print("No reply yet." if s is None else
              f"prompt tokens: {s.prompt_tokens}, reply tokens: {s.completion_tokens}, "
              f"{s.completion_tokens / max(s.seconds, 1e-9):.1f} tokens/s, "
              f"history: {len(history)} messages")
    else:
        print(f"Unknown command {cmd}; /help lists them.")
    return False


def _ctrl_c_interrupts() -> None:
    """Ctrl-C must reach the loop as KeyboardInterrupt (it stops a reply): a SIGINT that this
    process was started with ignored or blocked stays so across exec, and Python then installs
    no handler of its own (a parent that ignores or blocks it: nohup, some runners)."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.default_int_handler)


def chat_loop(backend: Any, system: str | None) -> int:
    """Read a line, send it with the conversation so far, stream the reply; until /bye or EOF."""
    _ctrl_c_interrupts()
    try:
        import readline  # noqa: F401 - line editing and recall for input()
    except ImportError:
        pass
    head = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    print(f"Chatting with {backend.name}. /help for commands, /bye or Ctrl-D to quit.")
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse /bye or Ctrl-D to quit.")
            continue
        if line.startswith("/"):
            if _chat_command(line, backend, history):
                return 0
            continue
        if not line:
            continue
        turn = {"role": "user", "content": line}
        reply = _reply(backend, [*head, *history, turn])
        if reply is not None:
            history += [turn, {"role": "assistant", "content": reply}]
