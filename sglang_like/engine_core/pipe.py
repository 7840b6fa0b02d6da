"""The engine core's output channel: length-prefixed frames over an OS pipe.

Outputs used to travel over a ZeroMQ PUSH/PULL pair. Each send there wakes ZeroMQ's I/O thread
in the sending process, which writes the socket and wakes the I/O thread of the receiving
process, which wakes the thread that reads the frame: three thread wake-ups per frame before
the reader runs. At batch 1 a frame goes out every decode step (~6 ms), and on a 2-core
machine every wake-up preempts one of the decode step's two OpenMP threads, which stalls the
other at its next barrier. Measured per streamed token through the server: the two I/O threads
took 0.1 ms of CPU and 2 of the ~6 context switches. A pipe written by the loop's own thread
and read by the client's receiver thread is one wake-up.

The writer never blocks the engine loop: the pipe is non-blocking, and what does not fit (the
reader is behind by more than the pipe holds) is written by a helper thread, in order, while
later frames queue behind it.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import select
import struct
import threading

_HEADER = struct.Struct("<I")
_PIPE_BYTES = 1 << 20  # asked of the kernel (F_SETPIPE_SZ); it may grant less
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, which Python has only from 3.10 on some builds


def make_pipe() -> tuple[int, int]:
    """(read fd, write fd), the pipe enlarged where the kernel allows (a full pipe only delays
    the writer's helper thread, never the loop, but a bigger one rarely fills)."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), _PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size for an unprivileged process: keep the default
    return r, w


class FrameWriter:
    """Writes frames to `fd` (the engine core's end); `send` never blocks on a slow reader."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)  # the core's own children must not hold the pipe open
        self._cv = threading.Condition()
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.broken = False  # the reader is gone (EPIPE): frames are dropped from then on

    def send(self, data: bytes) -> None:
        frame = _HEADER.pack(len(data)) + data
        with self._cv:
            if self.broken or self._closed:
                return
            if not self._backlog:
                try:
                    n = os.write(self.fd, frame)
                except BlockingIOError:
                    n = 0
                except BrokenPipeError:
                    self.broken = True
                    return
                if n == len(frame):
                    return
                frame = frame[n:]
            self._backlog.append(memoryview(frame))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, daemon=True,
                                                name="sglang-like-core-out")
                self._thread.start()
            self._cv.notify()

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while True:
            with self._cv:
                while not self._backlog and not self._closed:
                    self._cv.wait()
                if not self._backlog:
                    return
                chunk = self._backlog[0]
            poller.poll(1000)
            try:
                n = os.write(self.fd, chunk)
            except BlockingIOError:
                continue
            except OSError as exc:  # EPIPE: the reader is gone, nobody wants the rest
                if exc.errno != errno.EPIPE:
                    raise
                with self._cv:
                    self.broken = True
                    self._backlog.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                if n == len(chunk):
                    self._backlog.popleft()
                else:
                    self._backlog[0] = chunk[n:]
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (up to `timeout` seconds), then close the fd."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            if self._thread is not None:
                self._cv.wait_for(lambda: not self._backlog, timeout)
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        os.close(self.fd)


class FrameReader:
    """Splits the bytes read from the pipe into frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames = []
        at = 0
        while len(buf) - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, at)
            end = at + _HEADER.size + n
            if end > len(buf):
                break
            frames.append(bytes(buf[at + _HEADER.size : end]))
            at = end
        if at:
            del buf[:at]
        return frames

    @property
    def num_pending_bytes(self) -> int:
        return len(self._buf)
