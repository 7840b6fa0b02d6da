"""The installed `sglang-like` command: `chat` driven in a real pseudo-terminal (in-process and
over --url), `serve MODEL`, `generate MODEL`, and the command line's refusals."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from router_cluster import this_folders_conftest  # noqa: E402

from sglang_like.model_loader import default_model_path  # noqa: E402

_conftest = this_folders_conftest()
PROMPT = ">>> "
_LOAD_TIMEOUT_S = 240.0
_TURN_TIMEOUT_S = 60.0
_STATS = re.compile(r"prompt tokens: (\d+), reply tokens: (\d+)")


def _script() -> str:
    path = shutil.which("sglang-like")
    if path is None:
        pytest.fail("the `sglang-like` console script is not installed: run `pip install -e .` "
                    "in the repository (pyproject.toml's [project.scripts])")
    return path


def _take_terminal() -> None:
    """In the child, after setsid: the pty becomes its controlling terminal, so Ctrl-C typed
    there is a SIGINT to it, as in a real terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A command in a pseudo-terminal of its own; its output is read as it comes, one os.read
    at a time, so a test can see whether a reply arrived in pieces."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        # 50 rows x 200 columns: readline redraws nothing on the short lines typed here
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([_script(), *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, start_new_session=True,
                                     preexec_fn=_take_terminal)
        os.close(slave)
        self.fd = master
        self.pending = ""  # read but not yet consumed by expect()
        self.log = ""  # everything read, for failure messages

    def read(self, deadline: float) -> str:
        timeout = deadline - time.monotonic()
        if timeout <= 0 or not select.select([self.fd], [], [], timeout)[0]:
            raise AssertionError(f"timed out; the terminal so far:\n{self.log[-3000:]}")
        try:
            data = os.read(self.fd, 65536).decode("utf-8", "replace").replace("\r\n", "\n")
        except OSError:  # EIO: the command exited and closed the terminal
            data = ""
        if not data:
            raise AssertionError(f"the command exited ({self.proc.wait(5)}); the terminal:\n"
                                 f"{self.log[-3000:]}")
        self.log += data
        return data

    def expect(self, marker: str, timeout: float = _TURN_TIMEOUT_S) -> list[str]:
        """Read until `marker`; the reads up to it (the last cut after the marker)."""
        deadline = time.monotonic() + timeout
        reads, seen = [self.pending] if self.pending else [], self.pending
        while marker not in seen:
            reads.append(self.read(deadline))
            seen += reads[-1]
        cut = len(seen) - seen.index(marker) - len(marker)
        self.pending = reads[-1][len(reads[-1]) - cut:] if cut else ""
        reads[-1] = reads[-1][:len(reads[-1]) - cut]
        return reads

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def ask(self, line: str) -> tuple[str, int]:
        """Type a line at the prompt; the reply, and how many reads carried reply text before
        the next prompt came back."""
        self.send(line + "\r")
        reads = self.expect(line + "\n")  # the echo
        reads = self.expect(PROMPT)
        text = "".join(reads)[:-len(PROMPT)]
        pieces = [r for r in reads if r.strip() and PROMPT not in r]
        return text.strip(), len(pieces)

    def stats(self) -> tuple[int, int]:
        """(prompt tokens, reply tokens) of the last reply, from /stats."""
        self.send("/stats\r")
        match = _STATS.search("".join(self.expect(PROMPT)))
        assert match is not None, self.log[-2000:]
        return int(match[1]), int(match[2])

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            os.close(self.fd)


def _check_chat(term: Terminal) -> int:
    """Two turns streamed, the second on the first's history; the first turn's prompt size."""
    reply, num_pieces = term.ask("My name is Ana. Say hi in three words.")
    assert reply and num_pieces > 1, f"the reply did not stream: {term.log[-2000:]}"
    first_prompt, first_reply = term.stats()
    reply, num_pieces = term.ask("What is my name?")
    assert reply and num_pieces > 1, term.log[-2000:]
    second_prompt, _ = term.stats()
    # the second prompt holds the first turn: its question and the whole reply
    assert second_prompt > first_prompt + first_reply, (first_prompt, first_reply, second_prompt)
    return first_prompt


@pytest.mark.slow
def test_chat_in_process_streams_remembers_stops_and_quits() -> None:
    # a reply long enough (2000 tokens: seconds even on a fast machine) that the Ctrl-C below
    # lands inside it however late a loaded machine schedules this test's process
    term = Terminal("chat", "--max-tokens", "2000", "--temperature", "0")
    try:
        term.expect(PROMPT, timeout=_LOAD_TIMEOUT_S)
        first_prompt = _check_chat(term)
        term.send("/clear\r")
        assert "Cleared" in "".join(term.expect(PROMPT))
        # Ctrl-C in a reply (up to 2000 tokens of poem) stops it and returns to the prompt
        term.send("Write a long poem about the sea.\r")
        term.expect("sea.\n")
        reads = [term.read(time.monotonic() + _TURN_TIMEOUT_S)]
        term.send("\x03")
        reads += term.expect(PROMPT)
        assert "(stopped)" in "".join(reads), term.log[-2000:]
        # neither the cleared turns nor the stopped one are in the conversation any more
        term.ask("My name is Ana. Say hi in three words.")
        assert term.stats()[0] == first_prompt
        term.send("/help\r")
        assert "/clear" in "".join(term.expect(PROMPT))
        term.send("\x04")  # Ctrl-D at the prompt
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()


# ---- one server, started by `sglang-like serve MODEL` ----------------------------------------
@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    port = _conftest.free_port()
    proc = subprocess.Popen([_script(), "serve", default_model_path(), "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server = _conftest.RealServer(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + _LOAD_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"`sglang-like serve` exited {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "`sglang-like serve` did not become healthy"
        time.sleep(0.25)
    yield server.url
    assert _conftest.stop_real_server(server) == 0


@pytest.mark.slow
def test_serve_takes_the_model_as_its_first_argument(served: str) -> None:
    info = httpx.get(served + "/get_server_info", timeout=10).json()
    assert info["model_path"] == default_model_path()


@pytest.mark.slow
def test_chat_over_url_streams_remembers_and_says_bye(served: str) -> None:
    term = Terminal("chat", "--url", served, "--max-tokens", "24", "--temperature", "0",
                    "--system", "You are a terse assistant.")
    try:
        assert "Chatting with" in "".join(term.expect(PROMPT, timeout=30))
        _check_chat(term)
        term.send("/bye\r")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()


@pytest.mark.slow
def test_generate_prints_the_engines_completion(served: str) -> None:
    prompt, params = "The capital of France is", {"max_new_tokens": 8, "temperature": 0.0}
    resp = httpx.post(served + "/generate", json={"text": prompt, "sampling_params": params},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    want = resp.json()["text"]
    out = subprocess.run([_script(), "generate", default_model_path(), "--prompt", prompt,
                          "--max-new-tokens", "8", "--temperature", "0"],
                         capture_output=True, text=True, timeout=_LOAD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert want and out.stdout == want + "\n"


# ---- refusals: exit status 2 and a message, before any model loads ---------------------------
def _closed_port_url() -> str:
    return f"http://127.0.0.1:{_conftest.free_port()}"


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "/no/such/model.gguf"], "does not exist"),
    (["serve", "MODEL", "--model-path", "MODEL"], "give the model once"),
    (["generate", "MODEL", "--model-path", "MODEL", "--prompt", "x"], "give the model once"),
    (["generate", "/no/such/model.gguf", "--prompt", "x"], "does not exist"),
    (["chat", "MODEL", "--url", "http://127.0.0.1:1"], "give no MODEL"),
    (["chat", "--url", "ftp://127.0.0.1:1"], "http://"),
    (["chat", "--url", "CLOSED"], "cannot reach"),
    (["chat", "--temperature", "-1"], "temperature"),
    (["chat", "--max-tokens", "0"], "max-tokens"),
])
def test_refusals_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from sglang_like.__main__ import main

    model = default_model_path()
    argv = [model if a == "MODEL" else _closed_port_url() if a == "CLOSED" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
