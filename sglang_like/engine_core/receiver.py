"""Who reads the engine core's output pipe: a thread of the client's, or an asyncio loop.

By default a receiver thread reads the pipe and hands each frame to the client, which routes
the outputs to their callers (a sync caller's queue, or an asyncio caller's loop through
`call_soon_threadsafe`). A server's event loop can take the reading over (`attach`): the
frames are then read and routed on the loop that streams them out, with no thread in between.
Measured per streamed token at batch 1 through the server on a 2-core machine, the receiver
thread cost 0.16-0.18 ms of CPU and about two context switches (its wake-up, and a preemption
when it woke the loop while holding the GIL), each of which can take a CPU from the decode
step's OpenMP team.

Either way the reader also watches the core process (a pidfd where the kernel has them, and
the pipe's end of file): when the core is gone it takes what the core sent before and reports
the exit once (`on_exit`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable

from sglang_like.engine_core.pipe import FrameReader

logger = logging.getLogger(__name__)

_POLL_MS = 500  # without a pidfd: how often a reader that saw nothing checks the process


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll the process instead
        return None


class OutputReceiver:
    """Reads frames from `fd` (the core's output pipe) and calls `dispatch(frame)` for each, in
    order; calls `on_exit(returncode)` once, after the last frame, when the core is gone, or
    `on_failure(exc)` if reading itself failed."""

    def __init__(self, fd: int, proc: subprocess.Popen, dispatch: Callable[[bytes], None],
                 on_exit: Callable[[int], None], on_failure: Callable[[Exception], None],
                 reader: FrameReader | None = None) -> None:
        """`reader`: the one that read the pipe so far (a frame it holds in part goes on)."""
        self.fd = fd
        self.proc = proc
        self._dispatch = dispatch
        self._on_exit = on_exit
        self._on_failure = on_failure
        self._frames = reader or FrameReader()
        self._pidfd = _pidfd(proc.pid)
        self._wake_r, self._wake_w = os.pipe()  # tells the thread to hand the pipe over
        self._handover = False
        self._lock = threading.Lock()
        self._finished = threading.Event()  # on_exit / on_failure has run
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None  # the attached loop's thread
        self._eof = False
        self._thread = self._start_thread()

    # ---- reading ---------------------------------------------------------------------------
    def _read(self) -> list[bytes] | None:
        """The whole frames readable now (the pipe must be readable); None at end of file."""
        data = os.read(self.fd, 1 << 20)
        if not data:
            self._eof = True
            return None
        return self._frames.feed(data)

    def _readable(self, timeout_ms: int = 0) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(timeout_ms))

    def _take(self, timeout_ms: int | None = 0) -> bool:
        """Read and dispatch what is readable within `timeout_ms` (None: the pipe is known to
        be readable); False at end of file."""
        if self._eof:
            return False
        if timeout_ms is not None and not self._readable(timeout_ms):
            return True
        frames = self._read()
        if frames is None:
            return False
        for frame in frames:
            self._dispatch(frame)
        return True

    def _finish(self) -> None:
        """The core is gone: dispatch what it sent before, then report its exit (once)."""
        if self._finished.is_set():
            return
        try:
            while not self._eof and self._readable():
                self._take()
            code = self.proc.wait()
        except Exception as exc:  # noqa: BLE001 - reported like any other reader failure
            self._fail(exc)
            return
        self._finished.set()
        self._close_pidfd()
        self._on_exit(code)

    def _fail(self, exc: Exception) -> None:
        if not self._finished.is_set():
            self._finished.set()
            self._close_pidfd()
            self._on_failure(exc)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # ---- on a thread ------------------------------------------------------------------------
    def _start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._run_thread, name="sglang-like-core-client",
                             daemon=True)
        t.start()
        return t

    def _run_thread(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        try:
            while True:
                events = dict(poller.poll(None if self._pidfd is not None else _POLL_MS))
                if self._wake_r in events:
                    os.read(self._wake_r, 64)
                    if self._handover:
                        return  # an event loop reads from here on (attach)
                if self.fd in events and self._take(None):
                    continue
                if self._eof or (self._pidfd is not None and self._pidfd in events) or (
                        self._pidfd is None and self.proc.poll() is not None):
                    self._finish()
                    return
        except Exception as exc:  # noqa: BLE001 - nobody would route outputs any more
            logger.exception("the engine client's receiver failed")
            self._fail(exc)

    # ---- on an event loop -------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Read on `loop` from now on (call on the loop's thread); False if the core is gone
        already (the thread has reported it) or a loop reads already."""
        with self._lock:
            if self.loop is not None or self._finished.is_set():
                return False
            self._handover = True
            os.write(self._wake_w, b"x")
            self._thread.join()  # it takes nothing more once it has seen the wake-up
            self._handover = False
            if self._finished.is_set():
                return False
            self.loop, self.loop_thread = loop, threading.get_ident()
            loop.add_reader(self.fd, self._on_readable)
            if self._pidfd is not None:
                loop.add_reader(self._pidfd, self._on_loop_exit)
            else:
                loop.call_later(_POLL_MS / 1000, self._poll_process)
            return True

    def detach(self) -> None:
        """Hand the reading back to a thread (call on the attached loop's thread, before the
        loop closes)."""
        with self._lock:
            loop = self.loop
            if loop is None:
                return
            self._remove_readers()
            self.loop = self.loop_thread = None
            if not self._finished.is_set():
                self._thread = self._start_thread()

    def _remove_readers(self) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        loop.remove_reader(self.fd)
        if self._pidfd is not None:
            loop.remove_reader(self._pidfd)

    def _on_readable(self) -> None:
        try:
            if self._take(None):
                return
        except Exception as exc:  # noqa: BLE001 - as the thread's
            logger.exception("the engine client's receiver failed")
            self._remove_readers()
            self._fail(exc)
            return
        # end of file: the core is exiting; its pidfd (or the poll) reports when it is gone
        if self.proc.poll() is not None:
            self._on_loop_exit()
        else:
            self.loop.remove_reader(self.fd)

    def _on_loop_exit(self) -> None:
        if self.proc.poll() is None and self._pidfd is None:
            return  # end of file before the exit: _poll_process sees it
        self._remove_readers()
        self._finish()

    def _poll_process(self) -> None:
        if self.loop is None or self._finished.is_set():
            return
        if self.proc.poll() is not None:
            self._on_loop_exit()
        else:
            self.loop.call_later(_POLL_MS / 1000, self._poll_process)

    # ---- for a caller that waits on the attached loop's own thread --------------------------
    def pump_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Read and dispatch on this thread until `done()` (an RPC answered) or `timeout_s`
        passed: a blocking call made on the attached loop's thread would otherwise wait for
        frames only that loop reads."""
        deadline = time.monotonic() + timeout_s
        while not done() and not self._finished.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not self._take(int(min(left, 0.05) * 1000)) or self.proc.poll() is not None:
                self._remove_readers()
                self._finish()

    @property
    def on_loop_thread(self) -> bool:
        return self.loop_thread is not None and threading.get_ident() == self.loop_thread

    def join(self, timeout: float) -> None:
        """Wait until the core's exit is reported (the thread, or the loop, saw it)."""
        if self.loop is None:
            self._thread.join(timeout)
        else:
            self._finished.wait(timeout)

    def close(self) -> None:
        self._close_pidfd()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
