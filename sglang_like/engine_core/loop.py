"""The engine's loop thread: its inbox, the live requests' handles, and one answer per request.

Whatever happens, every request that was submitted gets exactly one final answer: its output,
or an abort whose message says why (`aborted`, `internal error: ...`, `server shutting
down`). A fault inside a scheduler step ends that step's batch (the scheduler's job); a fault
in a command or while delivering ends only that request; if the loop itself ever dies, the
requests it held and every later submission are answered with the reason, and
`check_health` says so.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_like.engine_core.io import RequestHandle, build_output
from sglang_like.req import FinishReason, Req, internal_error_message
from sglang_like.utils.cpu_runtime import trim_heap
from sglang_like.utils.stats_window import RequestLatency

if TYPE_CHECKING:
    from sglang_like.scheduler import Scheduler

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "server shutting down"
GRAMMAR_WAIT_S = 60.0  # a constraint that has not compiled by then ends its request
_DERIVED_RID = re.compile(r"(?:-\d+)+")


def is_derived_rid(rid: str, parent: str) -> bool:
    """`parent-0`, `parent-1-2`, ...: the rids the engine gives the samples of n > 1 and the
    items of a batch submitted under one rid (so aborting the parent reaches them all)."""
    return rid.startswith(parent) and _DERIVED_RID.fullmatch(rid, len(parent)) is not None


def error_output(rid: str, message: str) -> dict:
    """A final answer built without the request's state (when building the real one failed)."""
    return {"text": "", "output_ids": [], "meta_info": {
        "id": rid, "finish_reason": {"type": "abort", "message": message},
        "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "spec_verify_ct": 0,
        "e2e_latency": 0.0, "queue_time": 0.0}}


class LoopHooks:
    """What the loop tells its host besides answering handles (the engine-core process sends
    the outputs of an iteration as one message and publishes its load; see process.py)."""

    def step_started(self, t: float | None) -> None:
        """A scheduler step begins (perf_counter time) or ends (None)."""

    def iteration_done(self, loop: EngineLoop) -> None:
        """One pass of the loop (commands, then maybe a step) is over."""


class EngineLoop:
    """Runs on the engine's loop thread; `submit_all`, `put_command` and `check_health` are the
    only calls other threads make.

    A constrained request is compiled here, off the caller's path: it waits (aborts reach it)
    until its grammar is ready, then joins the scheduler; an invalid grammar ends it with an
    abort whose finish reason carries `status_code: 400` (the Engine raises that as a
    ValueError for a single request).
    """

    def __init__(self, tokenizer: Any, watchdog_timeout: float,
                 grammar_backend: Callable[[], Any] | None = None,
                 hooks: LoopHooks | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1; got {stream_interval}")
        self.tokenizer = tokenizer
        self.watchdog_timeout = watchdog_timeout
        self.stream_interval = stream_interval
        self.scheduler: Scheduler | None = None  # set once the model is built
        self._grammar_backend = grammar_backend
        self.hooks = hooks or LoopHooks()
        # requests waiting for their grammar: rid -> (req, future, deadline)
        self._compiling: dict[str, tuple[Req, Any, float]] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()  # guards _closed_message against submit_all
        self._closed_message: str | None = None  # set when the loop stops taking requests
        self.error: BaseException | None = None  # what killed the loop, if anything did
        self._step_started: float | None = None
        # TTFT / TPOT / e2e / queue time of the requests finished in the last minute
        self.request_latency = RequestLatency()

    # ---- other threads ---------------------------------------------------------------------
    def submit_all(self, items: list[tuple[Req, RequestHandle]]) -> None:
        """Queue the requests of one call (a batch of prompts, n samples) as one arrival: the
        loop takes them in the same iteration, so such a call is scheduled the same way every
        time, not split by when the loop woke. Once the loop has stopped, answer them at once
        with the reason."""
        with self._lock:
            message = self._closed_message
            if message is None:
                self._inbox.put(("add", items))
                return
        for req, handle in items:
            req.finish(FinishReason("abort", message=message))
            handle.put(self._output(req))

    def put_command(self, name: str, arg: Any = None) -> None:
        """Queue a command; once the loop has stopped, a `call` fails at once (others drop)."""
        with self._lock:
            message = self._closed_message
            if message is None:
                self._inbox.put((name, arg))
                return
        if name == "call":
            arg[1].put((False, RuntimeError(message)))

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar before they join the scheduler."""
        return len(self._compiling)

    @property
    def num_pending_commands(self) -> int:
        return self._inbox.qsize() + len(self._compiling)

    def check_health(self) -> str | None:
        """None while the loop serves; else why not (dead, stopped, or a step stuck)."""
        if self.error is not None:
            return f"the engine loop died: {type(self.error).__name__}: {self.error}"
        if self._closed_message is not None:
            return f"the engine loop is not running ({self._closed_message})"
        started = self._step_started
        if started is not None:
            elapsed = time.perf_counter() - started
            if elapsed > self.watchdog_timeout:
                return (f"a scheduler step has run for {elapsed:.0f} s (watchdog timeout "
                        f"{self.watchdog_timeout:g} s)")
        return None

    # ---- the loop thread -------------------------------------------------------------------
    def run(self) -> None:
        message = SHUTDOWN_MESSAGE
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - every caller still gets an answer
            logger.critical("the engine loop died", exc_info=True)
            self.error = exc
            message = internal_error_message(exc)
        finally:
            self._close(message)

    def _serve(self) -> None:
        sched = self.scheduler
        assert sched is not None
        hooks = self.hooks
        while True:
            try:
                commands = [self._inbox.get(timeout=self._wait_timeout())]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for name, arg in commands:
                if name == "stop":
                    return  # _close answers the rest
                self._command(name, arg)
            if self._compiling:
                self._poll_grammars()
            if sched.has_work:
                self._step_started = time.perf_counter()
                hooks.step_started(self._step_started)
                touched = sched.step()  # ends its own batch on a fault; never raises for one
                self._step_started = None
                hooks.step_started(None)
                for req in touched:
                    self._deliver(req)
                if not sched.has_work:  # going idle: hand back the batch's temporaries
                    trim_heap()
            hooks.iteration_done(self)

    def _wait_timeout(self) -> float | None:
        """How long the inbox may block: not at all with work to do; until the first grammar
        deadline while constraints compile (a finished compile wakes the loop itself)."""
        if self.scheduler.has_work:
            return 0
        if self._compiling:
            first = min(deadline for _, _, deadline in self._compiling.values())
            return max(first - time.perf_counter(), 0.0)
        return None

    def _command(self, name: str, arg: Any) -> None:
        if name == "add":
            for req, handle in arg:
                try:
                    self._add(req, handle)
                except Exception as exc:  # noqa: BLE001 - this request only
                    logger.exception("adding request %s failed", req.rid)
                    self._fail(req, internal_error_message(exc))
            return
        try:
            if name == "abort":
                self._abort(arg)
            elif name == "abort_all":
                for req in self._end_compiling("aborted") + self.scheduler.abort_all("aborted"):
                    self._deliver(req)
            elif name in ("grammar_ready", "wake"):
                pass  # a wake-up: _serve polls the compiles (and steps) after the commands
            elif name == "call":
                fn, done = arg
                try:
                    done.put((True, fn()))
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    done.put((False, exc))
        except Exception:  # noqa: BLE001 - a bug here must not end the loop
            logger.exception("engine command %r failed", name)

    def _add(self, req: Req, handle: RequestHandle) -> None:
        if req.rid in self._handles:  # its outputs would go to the other request's caller
            req.finish(FinishReason("abort", message=f"rid {req.rid!r} is already in use"))
            handle.put(self._output(req))
            return
        self._handles[req.rid] = handle
        if req.invalid_message is not None:
            self.scheduler.finish_outside_step(
                req, FinishReason("abort", message=req.invalid_message))
        elif (req.grammar is None and req.sampling_params.constraint is not None
              and self._grammar_backend is not None):
            kind, spec = req.sampling_params.constraint
            future = self._grammar_backend().get_future(kind, spec)
            self._compiling[req.rid] = (req, future, time.perf_counter() + GRAMMAR_WAIT_S)
            future.add_done_callback(lambda _: self._inbox.put(("grammar_ready", None)))
        else:
            self.scheduler.add_request(req)

    def _poll_grammars(self) -> None:
        """Hand the requests whose grammar is ready (or late, or invalid) on."""
        from constrained import InvalidGrammar

        now = time.perf_counter()
        for rid, (req, future, deadline) in list(self._compiling.items()):
            if not future.done() and now < deadline:
                continue
            del self._compiling[rid]
            if not future.done():  # left to finish (its result is a fresh grammar: dropped)
                message = f"the constraint did not compile within {GRAMMAR_WAIT_S:g} s"
            else:
                try:
                    grammar, message = future.result(), None
                except Exception as exc:  # noqa: BLE001 - a crashed compile: this request only
                    message = internal_error_message(exc)
            if message is not None:
                self.scheduler.finish_outside_step(req, FinishReason("abort", message=message))
                continue
            if isinstance(grammar, InvalidGrammar):
                self.scheduler.finish_outside_step(req, FinishReason(
                    "abort", message=grammar.message, status_code=400))
            else:
                req.grammar = grammar
                self.scheduler.add_request(req)

    def _end_compiling(self, message: str) -> list[Req]:
        ended = []
        for req, _, _ in self._compiling.values():
            req.finish(FinishReason("abort", message=message))
            ended.append(req)
        self._compiling.clear()
        return ended

    def _abort(self, rid: str) -> None:
        """Abort `rid` and the requests derived from it (n > 1 samples, batch items)."""
        targets = [r for r in self._handles if r == rid or is_derived_rid(r, rid)]
        for target in targets:
            compiling = self._compiling.pop(target, None)
            if compiling is not None:
                self.scheduler.finish_outside_step(
                    compiling[0], FinishReason("abort", message="aborted"))
            else:
                self.scheduler.abort(target)

    def _fail(self, req: Req, message: str) -> None:
        """End one request whose handling raised: free what it holds, answer its caller."""
        req.finish(FinishReason("abort", message=message))
        try:
            self.scheduler.abort(req.rid)  # still queued or running: take it out, free it
        except Exception:  # noqa: BLE001
            logger.exception("could not take %s out of the scheduler", req.rid)
        self._answer(req.rid, error_output(req.rid, message))

    def _output(self, req: Req) -> dict:
        """A request's output as the loop sends it: the whole result, or (streams) what is new;
        logprob entries without their text, which the caller's handle adds."""
        return build_output(req, self.tokenizer, False, req.stream)

    def _answer(self, rid: str, out: dict) -> None:
        handle = self._handles.pop(rid, None)
        if handle is not None and not handle.done:
            handle.put(out)

    def _deliver(self, req: Req) -> None:
        handle = self._handles.get(req.rid)
        if handle is None:
            return
        try:
            if req.is_finished or (req.stream and self._stream_due(req)):
                handle.put(self._output(req))
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer bug: this request only
            logger.exception("building the output of %s failed", req.rid)
            self._fail(req, internal_error_message(exc))
            return
        if req.is_finished:
            self._handles.pop(req.rid, None)
            self.request_latency.observe(req)

    def _stream_due(self, req: Req) -> bool:
        """Whether a running stream gets a chunk now (see ServerArgs.stream_interval): its
        first tokens at once, then once `stream_interval` tokens are new (a verify may commit
        several in one step)."""
        return (self.stream_interval == 1 or req.num_sent_ids == 0
                or len(req.output_ids) - req.num_sent_ids >= self.stream_interval)

    def _close(self, message: str) -> None:
        """Stop taking requests and answer everyone: queued commands, requests in the
        scheduler, requests that finished outside a step, and any handle still open."""
        with self._lock:
            self._closed_message = message
        self._step_started = None
        ended_early = self._end_compiling(message)
        while True:
            try:
                name, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if name == "add":
                for req, handle in arg:
                    req.finish(FinishReason("abort", message=message))
                    try:
                        handle.put(self._output(req))
                    except Exception:  # noqa: BLE001
                        handle.put(error_output(req.rid, message))
            elif name == "call":
                arg[1].put((False, RuntimeError(message)))
        sched = self.scheduler
        if sched is not None:
            try:
                ended = sched.take_finished_outside_step() + sched.abort_all(message)
            except Exception:  # noqa: BLE001 - a broken scheduler: the handles still answer
                logger.exception("aborting the scheduler's requests failed")
                ended = []
            for req in ended_early + ended:
                self._safe_deliver(req)
        for rid in list(self._handles):
            self._answer(rid, error_output(rid, message))
        if sched is not None:
            try:
                self.hooks.iteration_done(self)  # the last answers go out
            except Exception:  # noqa: BLE001
                logger.exception("sending the last answers failed")

    def _safe_deliver(self, req: Req) -> None:
        try:
            self._deliver(req)
        except Exception:  # noqa: BLE001 - answered by the last sweep of _close
            logger.exception("delivering %s at shutdown failed", req.rid)
