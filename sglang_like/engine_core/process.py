"""The engine-core process: `python -m sglang_like.engine_core ARGS_FILE` (started by
ProcessCoreClient, never by hand).

Its main thread builds the model and runs the loop (every torch op on one thread, see
ThreadCoreClient); a receiver thread turns incoming messages into the loop's commands. Each
loop iteration sends everything it produced as one frame down the output pipe (`pipe.py`: the
loop's thread writes it, no I/O thread in between), and publishes the load and the
running step's start time in a small shared file the client reads without asking (admission,
/health's watchdog). If the parent goes away the core stops by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import os
import pickle
import signal
import struct
import threading
import time
import traceback
from typing import Any

import zmq

from sglang_like.engine_core import messages as m
from sglang_like.engine_core.core import EngineCore, make_req
from sglang_like.engine_core.loop import LoopHooks, error_output
from sglang_like.engine_core.pipe import FrameWriter
from sglang_like.req import internal_error_message

logger = logging.getLogger("sglang_like.engine_core")

# the shared stats file: step start (perf_counter, 0 = no step), running, waiting, KV slots used
STATS_FORMAT = "<dqqq"
STATS_SIZE = struct.calcsize(STATS_FORMAT)
_PARENT_POLL_MS = 500


class RemoteHandle:
    """The loop's handle of a request whose caller is in the other process."""

    def __init__(self, rid: str, outbox: Outbox, stream: bool) -> None:
        self.rid = rid
        self.stream = stream
        self.done = False
        self._outbox = outbox

    def put(self, out: dict) -> None:
        if out["meta_info"]["finish_reason"] is not None:
            self.done = True
        self._outbox.add(m.ReqOutput(self.rid, out))


class RpcAnswer:
    """Stands for the reply queue of a `call` command (`put((ok, value))`)."""

    def __init__(self, call_id: int, outbox: Outbox) -> None:
        self.call_id = call_id
        self._outbox = outbox

    def put(self, result: tuple[bool, Any]) -> None:
        ok, value = result
        if ok:
            self._outbox.add(m.RpcReply(self.call_id, True, value))
        else:
            self._outbox.add(m.RpcReply(
                self.call_id, False, error=f"{type(value).__name__}: {value}",
                refused=str(value) if isinstance(value, ValueError) else None))


class Outbox(LoopHooks):
    """Collects the loop's messages and sends them once per iteration; keeps the stats file."""

    def __init__(self, out: FrameWriter, stats: mmap.mmap) -> None:
        self._out = out
        self._stats = stats
        self._lock = threading.Lock()  # the receiver thread answers too, once the loop closed
        self._pending: list[Any] = []
        self._running = self._waiting = self._tokens = 0

    def add(self, msg: Any) -> None:
        with self._lock:
            self._pending.append(msg)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            if pending:
                self._out.send(m.encode(pending))

    def step_started(self, t: float | None) -> None:
        struct.pack_into("<d", self._stats, 0, t or 0.0)

    def iteration_done(self, loop: Any) -> None:
        self.flush()
        scheduler = loop.scheduler
        running = len(scheduler.running)
        # requests only: commands still in the inbox (an RPC, an abort) would be counted after
        # the loop has gone idle, with no later iteration to correct the figure
        waiting = len(scheduler.waiting) + loop.num_compiling
        tokens = scheduler.kv_pool_info()["used_slots"] if running else 0
        if (running, waiting, tokens) != (self._running, self._waiting, self._tokens):
            self._running, self._waiting, self._tokens = running, waiting, tokens
            struct.pack_into("<qqq", self._stats, 8, running, waiting, tokens)


def _receive(core: EngineCore, sock: zmq.Socket, outbox: Outbox, parent_pid: int) -> None:
    """The receiver thread: messages in -> loop commands; stops the loop if the parent died."""
    loop = core.loop
    while True:
        if not sock.poll(_PARENT_POLL_MS):
            if os.getppid() != parent_pid:
                logger.warning("the engine's parent process is gone; stopping")
                loop.put_command("stop")
                return
            continue
        msg = m.decode_in(sock.recv())
        if isinstance(msg, m.GenerateReqInput | m.GenerateBatch):
            loop.submit_all(_requests(msg, outbox))
        elif isinstance(msg, m.AbortReq):
            if msg.rid is None:
                loop.put_command("abort_all")
            else:
                loop.put_command("abort", msg.rid)
        elif isinstance(msg, m.RpcReq):
            if msg.method in EngineCore.RPC_METHODS:
                fn = functools.partial(getattr(core, msg.method), **msg.kwargs)
                loop.put_command("call", (fn, RpcAnswer(msg.call_id, outbox)))
            else:
                outbox.add(m.RpcReply(msg.call_id, False, error=f"no method {msg.method!r}"))
                outbox.flush()
        elif isinstance(msg, m.StopReq):
            loop.put_command("stop")
            return


def _requests(msg: m.GenerateReqInput | m.GenerateBatch,
              outbox: Outbox) -> list[tuple[Any, RemoteHandle]]:
    """The scheduler's requests for one message; one that cannot be built is answered with
    an error, the others go on."""
    items = []
    for one in msg.reqs if isinstance(msg, m.GenerateBatch) else [msg]:
        try:
            req = make_req(one)
        except Exception as exc:  # noqa: BLE001 - a message the Engine should not send
            logger.exception("bad request message %s", one.rid)
            outbox.add(m.ReqOutput(one.rid, error_output(one.rid, internal_error_message(exc))))
            outbox.flush()
            continue
        items.append((req, RemoteHandle(one.rid, outbox, one.stream)))
    return items


def _pin_loop(core: EngineCore) -> int | None:
    """With cpu_pinning on (the server's auto) on CPU, one rank: claim a core for the loop's
    thread (this one) and move the process's other threads, the OpenMP workers among them,
    off it; the core's number, which the HTTP process keeps off too (see cpu_runtime)."""
    from sglang_like.utils.cpu_runtime import claim_loop_cpu, keep_threads_off

    sa = core.server_args
    if sa.cpu_pinning != "on" or core.info.device != "cpu" or sa.tp_size != 1:
        return None
    cpu = claim_loop_cpu()
    if cpu is not None:
        moved = keep_threads_off(cpu, include_self=False)
        logger.debug("engine loop on core %d; %d other threads keep off it", cpu, moved)
    return cpu


def main(args_path: str) -> int:
    with open(args_path, "rb") as f:
        spec = pickle.load(f)
    server_args = spec["server_args"]
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # Ctrl-C reaches the whole process group: the parent decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec["in_addr"])
    out = FrameWriter(spec["out_fd"])
    with open(spec["stats_path"], "r+b") as f:
        stats = mmap.mmap(f.fileno(), STATS_SIZE)
    outbox = Outbox(out, stats)
    t0 = time.perf_counter()
    try:
        core = EngineCore(server_args, hooks=outbox)
    except BaseException as exc:  # noqa: BLE001 - told to the Engine, which raises it
        logger.debug("engine build failed", exc_info=True)
        out.send(m.encode([m.Ready(error_type=type(exc).__name__,
                                   error=str(exc) or traceback.format_exc())]))
        inbox.close(linger=0)
        out.close()  # delivers the message first
        return 1
    from sglang_like.utils.cpu_runtime import trim_heap

    trim_heap()  # the loader's temporaries
    core.info = dataclasses.replace(core.info, loop_cpu=_pin_loop(core))
    out.send(m.encode([m.Ready(info=pickle.dumps(core.info))]))
    logger.debug("engine core ready in %.1fs (pid %d)", time.perf_counter() - t0, os.getpid())
    receiver = threading.Thread(target=_receive, args=(core, inbox, outbox, spec["parent_pid"]),
                                name="sglang-like-core-receiver", daemon=True)
    receiver.start()
    core.loop.run()  # returns on "stop", or when the loop died (everyone answered either way)
    outbox.flush()
    core.shutdown_grammars()
    core.runner.close()  # tensor-parallel ranks get their stop message (os._exit skips atexit)
    core.shutdown_disaggregation()
    out.close()
    return 1 if core.loop.error is not None else 0

