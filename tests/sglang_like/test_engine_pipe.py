"""The engine core's output pipe (`engine_core/pipe.py`) and who reads it
(`engine_core/receiver.py`): frames arrive whole and in order, the writer never blocks the
engine loop on a slow reader, and the reader (a thread, or an asyncio loop that took over)
delivers every frame exactly once and reports the core's exit after the last one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from sglang_like.engine_core.pipe import FrameReader, FrameWriter, make_pipe
from sglang_like.engine_core.receiver import OutputReceiver

_F_SETPIPE_SZ = 1031


def _frames(n: int, size: int) -> list[bytes]:
    return [(f"{i:06d}".encode() * (size // 6 + 1))[:size] for i in range(n)]


def test_reader_splits_frames_at_any_chunk_boundary() -> None:
    payloads = [b"", b"a", b"hello world" * 50, bytes(range(256)) * 3]
    import struct

    stream = b"".join(struct.pack("<I", len(p)) + p for p in payloads)
    for step in (1, 3, 7, len(stream)):
        reader, got = FrameReader(), []
        for at in range(0, len(stream), step):
            got += reader.feed(stream[at : at + step])
        assert got == payloads
        assert reader.num_pending_bytes == 0


def test_writer_never_blocks_on_a_full_pipe_and_keeps_order() -> None:
    r, w = os.pipe()
    import fcntl

    fcntl.fcntl(w, _F_SETPIPE_SZ, 4096)  # a small pipe: most frames go to the backlog
    writer = FrameWriter(w)
    frames = _frames(200, 10_000)  # 2 MB, nobody reading yet
    sent = threading.Thread(target=lambda: [writer.send(f) for f in frames])
    sent.start()
    sent.join(timeout=10)
    assert not sent.is_alive(), "send blocked on a pipe nobody read"
    reader, got = FrameReader(), []
    closing = threading.Thread(target=writer.close)  # delivers the backlog, then closes
    closing.start()
    while True:
        data = os.read(r, 1 << 16)
        if not data:
            break
        got += reader.feed(data)
    closing.join(timeout=10)
    os.close(r)
    assert got == frames


def test_writer_drops_frames_once_the_reader_is_gone() -> None:
    r, w = os.pipe()
    writer = FrameWriter(w)
    os.close(r)
    writer.send(b"x" * 100)  # EPIPE: no exception into the engine loop
    assert writer.broken
    writer.send(b"y")
    writer.close()


_CHILD = """
import os, sys, time
from sglang_like.engine_core.pipe import FrameWriter
w = FrameWriter(int(sys.argv[1]))
n, pause = int(sys.argv[2]), float(sys.argv[3])
for i in range(n):
    w.send(b"frame %d" % i)
    time.sleep(pause)
w.close()
sys.exit(int(sys.argv[4]))
"""


def _spawn(n: int, pause: float, code: int) -> tuple[int, subprocess.Popen]:
    r, w = make_pipe()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(w), str(n), str(pause), str(code)],
                            pass_fds=(w,))
    os.close(w)
    return r, proc


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.threads: list[int] = []  # the thread each frame was read on
        self.exit_code: int | None = None
        self.exits = 0
        self.done = threading.Event()

    def dispatch(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.threads.append(threading.get_ident())

    def on_exit(self, code: int) -> None:
        self.exit_code = code
        self.exits += 1
        self.done.set()

    def on_failure(self, exc: Exception) -> None:
        raise AssertionError(f"reader failed: {exc}")


def test_thread_reader_delivers_every_frame_then_the_exit() -> None:
    r, proc = _spawn(50, 0.0, 3)
    sink = _Sink()
    rec = OutputReceiver(r, proc, sink.dispatch, sink.on_exit, sink.on_failure)
    assert sink.done.wait(30)
    rec.join(5)
    assert sink.frames == [b"frame %d" % i for i in range(50)]
    assert (sink.exit_code, sink.exits) == (3, 1)
    assert threading.get_ident() not in sink.threads
    rec.close()
    os.close(r)


@pytest.mark.parametrize("detach_midway", [False, True])
def test_a_loop_takes_the_reading_over_and_hands_it_back(detach_midway: bool) -> None:
    """Attached while frames are arriving: none lost or doubled across either handover, the
    loop's frames read on the loop's thread, the exit reported once."""
    r, proc = _spawn(120, 0.005, 0)
    sink = _Sink()
    rec = OutputReceiver(r, proc, sink.dispatch, sink.on_exit, sink.on_failure)

    async def main() -> int:
        deadline = time.monotonic() + 20
        while len(sink.frames) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)  # (blocking the loop) the thread reads the first frames
        assert rec.attach(asyncio.get_running_loop())
        assert rec.on_loop_thread
        loop_thread = threading.get_ident()
        await asyncio.sleep(0.2)
        if detach_midway:
            rec.detach()
            assert not rec.on_loop_thread
        else:
            while not sink.done.is_set():
                await asyncio.sleep(0.01)
            rec.detach()
        return loop_thread

    loop_thread = asyncio.run(main())
    assert sink.done.wait(30)
    assert sink.frames == [b"frame %d" % i for i in range(120)]
    assert sink.exits == 1 and sink.exit_code == 0
    on_loop = [t == loop_thread for t in sink.threads]
    assert not on_loop[0] and any(on_loop)  # the thread first, then the loop
    assert on_loop[-1] is not detach_midway  # ... and after a detach, a thread again
    rec.close()
    os.close(r)


def test_pump_reads_on_the_loop_thread_for_a_blocking_caller() -> None:
    """A blocking wait on the attached loop's own thread (an RPC) reads the pipe itself."""
    r, proc = _spawn(30, 0.01, 0)
    sink = _Sink()
    rec = OutputReceiver(r, proc, sink.dispatch, sink.on_exit, sink.on_failure)

    async def main() -> None:
        assert rec.attach(asyncio.get_running_loop())
        rec.pump_until(lambda: len(sink.frames) >= 20, 30)  # the loop never runs meanwhile
        assert len(sink.frames) >= 20
        rec.pump_until(sink.done.is_set, 30)
        assert sink.done.is_set()
        rec.detach()

    asyncio.run(main())
    assert sink.frames == [b"frame %d" % i for i in range(30)] and sink.exits == 1
    rec.close()
    os.close(r)
