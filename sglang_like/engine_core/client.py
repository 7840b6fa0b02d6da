"""ProcessCoreClient: the Engine's side of an engine core running in its own process.

It spawns `python -m sglang_like.engine_core`, sends it requests (ZeroMQ), and routes the
outputs that come back (frames on a pipe, `pipe.py`) to each request's handle, read on a
receiver thread or on a server's event loop (`receiver.py`). The reader also watches the
process (a pidfd, and the pipe's end): if the core dies, every request in flight ends at once
with an internal-error abort, `check_health` says why, and later requests are answered with
the same error.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from sglang_like.config import ServerArgs
from sglang_like.engine_core import messages as m
from sglang_like.engine_core.core import CoreInfo
from sglang_like.engine_core.io import RequestHandle
from sglang_like.engine_core.loop import SHUTDOWN_MESSAGE, error_output
from sglang_like.engine_core.pipe import FrameReader, make_pipe
from sglang_like.engine_core.process import STATS_SIZE
from sglang_like.engine_core.receiver import OutputReceiver

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 900.0  # loading a big checkpoint from a slow disk
_STOP_TIMEOUT_S = 30.0
_RPC_TIMEOUT_S = 120.0
_BUILTIN_ERRORS = {e.__name__: e for e in (ValueError, FileNotFoundError, TypeError,
                                           NotImplementedError, MemoryError, OSError)}


class EngineProcessError(RuntimeError):
    """The engine-core process could not start, or died."""


def _encode_requests(msgs: list[m.GenerateReqInput]) -> bytes:
    try:
        return m.encode(msgs[0] if len(msgs) == 1 else m.GenerateBatch(msgs))
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond 64 bits
        raise ValueError(f"the request cannot be sent to the engine: {exc}") from exc


class ProcessCoreClient:
    def __init__(self, server_args: ServerArgs) -> None:
        self._dir = tempfile.mkdtemp(prefix="sglang_like-core-")
        self._ctx = zmq.Context()
        self._send_sock = self._ctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.LINGER, 0)
        in_addr = f"ipc://{self._dir}/in"
        self._send_sock.bind(in_addr)
        self._out_fd, out_w = make_pipe()
        self._frames = FrameReader()
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._lock = threading.Lock()  # guards _handles, _calls and _dead against each other
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, list] = {}  # call_id -> [event, reply]
        self._call_ids = itertools.count()
        self._dead: str | None = None  # once set: the abort message of every later request
        self._stopping = False
        stats_path = os.path.join(self._dir, "stats")
        with open(stats_path, "wb") as f:
            f.write(b"\0" * STATS_SIZE)
        with open(stats_path, "r+b") as f:
            self._stats = mmap.mmap(f.fileno(), STATS_SIZE)
        args_path = os.path.join(self._dir, "args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump({"server_args": server_args, "in_addr": in_addr, "out_fd": out_w,
                         "stats_path": stats_path, "parent_pid": os.getpid()}, f)
        self.watchdog_timeout = server_args.watchdog_timeout
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_like.engine_core", args_path],
                stdin=subprocess.DEVNULL, env=_child_env(), pass_fds=(out_w,),
            )
        finally:
            os.close(out_w)  # the core holds the write end: its exit reads as end of file
        try:
            # the tokenizer loads here while the core loads the model
            self.tokenizer = _load_tokenizer(server_args)
            self.info: CoreInfo = self._wait_ready()
        except BaseException:
            self._kill()
            self._cleanup()
            raise
        self._grammar_backend: Any = None
        self._receiver = OutputReceiver(self._out_fd, self.proc, self._dispatch,
                                        self._on_core_exit, self._on_receiver_failure,
                                        self._frames)

    # ---- start-up --------------------------------------------------------------------------
    def _read_frames(self) -> list[bytes] | None:
        """The whole frames readable now (the pipe must be readable); None at end of file."""
        data = os.read(self._out_fd, 1 << 20)
        return self._frames.feed(data) if data else None

    def _wait_ready(self) -> CoreInfo:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        poller = select.poll()
        poller.register(self._out_fd, select.POLLIN)
        while True:
            frames = self._read_frames() if poller.poll(200) else []
            if frames:
                (msg,) = m.decode_out(frames[0])
                assert isinstance(msg, m.Ready), msg  # the core sends nothing else before
                if msg.error_type:
                    self.proc.wait(timeout=30)
                    raise _BUILTIN_ERRORS.get(msg.error_type, EngineProcessError)(msg.error)
                return pickle.loads(msg.info)
            code = self.proc.poll() if frames is not None else self.proc.wait(timeout=30)
            if code is not None:
                raise EngineProcessError(
                    f"the engine process exited with code {code} while loading the model")
            if time.monotonic() > deadline:
                raise EngineProcessError(f"the engine process was not ready after "
                                         f"{_READY_TIMEOUT_S:g} s")

    # ---- calls from any thread --------------------------------------------------------------
    def submit(self, msgs: list[m.GenerateReqInput], handles: list[RequestHandle]) -> None:
        """Send one call's requests in one message (see GenerateBatch); a request refused here
        (a rid in use, the core gone) is answered with the reason and the others go."""
        data = _encode_requests(msgs)  # one that cannot be sent stops them all, before any goes
        sent, refused = [], []
        with self._lock:
            for msg, handle in zip(msgs, handles, strict=True):
                message = self._dead
                if message is None and msg.rid in self._handles:
                    message = f"rid {msg.rid!r} is already in use"
                if message is None:
                    self._handles[msg.rid] = handle
                    sent.append(msg)
                else:
                    refused.append((handle, error_output(msg.rid, message)))
        for handle, output in refused:
            handle.put(output)
        if not sent:
            return
        if len(sent) < len(msgs):
            data = _encode_requests(sent)
        if any(h.loop is None for h in handles) and self._receiver.on_loop_thread:
            # a blocking caller on the loop that reads the outputs would wait for itself
            logger.warning("a blocking generate on the event loop the engine's outputs are "
                           "read on; reading them on a thread again")
            self._receiver.detach()
        with self._send_lock:
            self._send_sock.send(data, copy=False)

    def abort(self, rid: str | None) -> None:
        if self._dead is None:
            self._send(m.AbortReq(rid))

    def call(self, method: str, **kwargs: Any) -> Any:
        """Run an EngineCore RPC method on the loop; raises if the core is gone or fails."""
        call_id = next(self._call_ids)
        slot = [threading.Event(), None]
        with self._lock:
            if self._dead is not None:
                raise EngineProcessError(self._dead)
            self._calls[call_id] = slot
        self._send(m.RpcReq(call_id, method, kwargs))
        if self._receiver.on_loop_thread:  # the loop that would read the answer is this thread
            self._receiver.pump_until(slot[0].is_set, _RPC_TIMEOUT_S)
        if not slot[0].wait(0 if self._receiver.on_loop_thread else _RPC_TIMEOUT_S):
            with self._lock:
                self._calls.pop(call_id, None)
            raise TimeoutError(f"the engine did not answer {method} in {_RPC_TIMEOUT_S:g} s")
        reply = slot[1]
        if isinstance(reply, str):
            raise EngineProcessError(reply)
        if not reply.ok and reply.refused is not None:
            raise ValueError(reply.refused)
        if not reply.ok:
            raise EngineProcessError(f"{method} failed in the engine: {reply.error}")
        return reply.value

    def check_health(self) -> str | None:
        if self._dead is not None:
            return self._dead.removeprefix("internal error: ")
        started = struct.unpack_from("<d", self._stats, 0)[0]
        if started:
            elapsed = time.perf_counter() - started
            if elapsed > self.watchdog_timeout:
                return (f"a scheduler step has run for {elapsed:.0f} s (watchdog timeout "
                        f"{self.watchdog_timeout:g} s)")
        return None

    @property
    def num_queued(self) -> int:
        return struct.unpack_from("<q", self._stats, 16)[0]

    @property
    def grammar_backend(self) -> Any:
        """A backend of this process's own, for callers that inspect constraints (`supports`,
        `compile`); the requests' grammars are compiled in the engine process."""
        with self._lock:
            if self._grammar_backend is None:
                from sglang_like.engine_core.core import build_grammar_backend

                self._grammar_backend = build_grammar_backend(
                    self.tokenizer, self.info.model_config.vocab_size, self.info.eos_token_ids,
                    self.info.server_args.grammar_backend)
            return self._grammar_backend

    def attach_event_loop(self, loop: Any) -> bool:
        """Read the core's outputs on `loop` (a server's; call on its thread) instead of the
        receiver thread: the requests of that loop get theirs with no thread hop. False if
        the core is gone or a loop reads already. `detach_event_loop` before the loop ends."""
        return self._receiver.attach(loop)

    def detach_event_loop(self) -> None:
        self._receiver.detach()

    def shutdown(self) -> None:
        """Stop the core (it answers what is in flight), wait for it, clean up."""
        if self._receiver.on_loop_thread:
            self._receiver.detach()  # this thread is about to block: the thread reads again
        self._stopping = True
        if self.proc.poll() is None:
            try:
                self._send(m.StopReq())
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                logger.warning("the engine process did not stop in %g s; killing it",
                               _STOP_TIMEOUT_S)
                self._kill()
        self._receiver.join(timeout=10)
        self._mark_dead(SHUTDOWN_MESSAGE)
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown()
        self._cleanup()

    # ---- the receiver thread ----------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        data = m.encode(msg)
        with self._send_lock:
            self._send_sock.send(data, copy=False)

    def _on_core_exit(self, code: int) -> None:
        if self._stopping and code == 0:
            self._mark_dead(SHUTDOWN_MESSAGE)
        else:
            logger.error("the engine process exited with code %s", code)
            self._mark_dead(f"internal error: the engine process exited with code {code}")

    def _on_receiver_failure(self, exc: Exception) -> None:
        self._mark_dead(f"internal error: the engine client failed: {exc}")

    def _dispatch(self, data: bytes) -> None:
        # One wake-up per event loop per frame, not one per output: at batch 32 a frame holds
        # 32 stream chunks, and each call_soon_threadsafe writes the loop's self-pipe.
        by_loop: dict[Any, list[tuple[RequestHandle, dict]]] = {}
        for msg in m.decode_out(data):
            if isinstance(msg, m.ReqOutput):
                final = msg.out["meta_info"]["finish_reason"] is not None
                with self._lock:
                    handle = (self._handles.pop(msg.rid, None) if final
                              else self._handles.get(msg.rid))
                if handle is not None and not handle.prepare(msg.out):
                    by_loop.setdefault(handle.loop, []).append((handle, msg.out))
            elif isinstance(msg, m.RpcReply):
                with self._lock:
                    slot = self._calls.pop(msg.call_id, None)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
        here = self._receiver.loop if self._receiver.on_loop_thread else None
        for loop, items in by_loop.items():
            if loop is here:
                _deliver_all(items)  # read on that very loop: no hop
                continue
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _mark_dead(self, message: str) -> None:
        """From now on every request gets `message`; those in flight get it now."""
        with self._lock:
            if self._dead is None:
                self._dead = message
            message = self._dead
            handles, self._handles = self._handles, {}
            calls, self._calls = self._calls, {}
        for rid, handle in handles.items():
            if not handle.done:
                handle.put(error_output(rid, message))
        for slot in calls.values():
            slot[1] = message
            slot[0].set()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _cleanup(self) -> None:
        self._send_sock.close(linger=0)
        self._ctx.term()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.close()
        os.close(self._out_fd)
        self._stats.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _deliver_all(items: list[tuple[RequestHandle, dict]]) -> None:
    for handle, out in items:
        handle.deliver_in_loop(out)


def _load_tokenizer(server_args: ServerArgs) -> Any:
    from sglang_like.model_loader import load_tokenizer

    return load_tokenizer(server_args.tokenizer_path or server_args.model_path)


def _child_env() -> dict[str, str]:
    """The child imports this very package, wherever it was imported from here."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
