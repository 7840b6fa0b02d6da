"""Grammar compiles that cannot take the engine down.

A regex or schema can cost any amount to compile (outlines' index of `(a|b)*a(a|b){n}` grows
about 3x per step of n). A compile in the engine's own threads cannot be stopped: one past
its timeout keeps its thread and its memory, and one that runs out of memory ends the engine
and every request in it. So each new (kind, spec) is first compiled in a worker process whose
address space is capped (`memory_limit_mb` over what it holds when idle) and which is killed
at the compile timeout; only a spec that compiled there within both limits is compiled for
real, in the engine (the compile cache makes that once per spec). Workers are reused, and
replaced after `_TRIALS_PER_WORKER` compiles (compilers keep caches of their own).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from typing import Any

from constrained import GrammarBackend, InvalidGrammar, TokenizerInfo

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # a worker imports the compiler and reads the vocabulary
_TRIALS_PER_WORKER = 32


class _WorkerGone(Exception):
    """The worker died (its memory cap, a crash) or was killed at the timeout."""


class _Worker:
    """One compile process: `trial(kind, spec)` is None when the spec compiled there, else why
    not. Raises _WorkerGone when the process had to be, or was, lost."""

    def __init__(self, info: TokenizerInfo, backend: str, memory_limit_mb: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork the engine's threads
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, info, backend, memory_limit_mb),
                                   name="sglang-like-grammar", daemon=True)
        self.process.start()
        child.close()
        self.num_trials = 0
        if not self._conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise _WorkerGone("the grammar compile worker did not start")
        try:
            self._conn.recv()  # "ready"
        except EOFError:
            self.kill()
            raise _WorkerGone("the grammar compile worker failed to start") from None

    def trial(self, kind: str, spec: str, timeout_s: float) -> str | None:
        self.num_trials += 1
        try:
            self._conn.send((kind, spec))
            if not self._conn.poll(timeout_s):
                self.kill()
                raise _WorkerGone(f"{kind} compile took longer than {timeout_s:g}s "
                                  "(stopped)")
            return self._conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise _WorkerGone(f"{kind} compile ran out of its memory or crashed") from None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self._conn.close()


def _serve(conn: Any, info: TokenizerInfo, backend: str, memory_limit_mb: int) -> None:
    """The worker: compile what it is sent, answer None or the reason it did not compile."""
    import resource

    compiler = GrammarBackend(info, backend, num_threads=1, compile_timeout_s=1e9,
                              max_cache_entries=1)
    if memory_limit_mb > 0:
        # over what it holds now (the interpreter, the compiler, the vocabulary)
        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
        cap = vm_bytes + (memory_limit_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send("ready")
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return
        try:
            result = compiler.compile(kind, spec)
            conn.send(result.message if isinstance(result, InvalidGrammar) else None)
        except MemoryError:
            conn.send(f"{kind} compile ran out of its memory ({memory_limit_mb} MB)")


class IsolatedGrammarBackend(GrammarBackend):
    """A GrammarBackend whose compiles are tried in capped, killable worker processes first."""

    def __init__(self, tokenizer_info: TokenizerInfo, backend: str = "xgrammar",
                 memory_limit_mb: int = 2048, num_threads: int = 2,
                 compile_timeout_s: float = 30.0) -> None:
        super().__init__(tokenizer_info, backend, num_threads, compile_timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.num_killed = 0  # trials stopped at the timeout or lost to the memory cap
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._workers_lock = threading.Lock()
        self._closed = False

    def _safe_compile(self, kind: str, spec: str) -> Any:
        problem = self._trial(kind, spec)
        if problem is not None:
            return InvalidGrammar(f"{self.backend}: {problem}")
        return super()._safe_compile(kind, spec)

    def _trial(self, kind: str, spec: str) -> str | None:
        try:
            worker = self._take()
        except _WorkerGone as exc:
            return str(exc)
        try:
            problem = worker.trial(kind, spec, self.compile_timeout_s)
        except _WorkerGone as exc:
            self.num_killed += 1
            self._drop(worker)
            logger.warning("grammar compile stopped: %s", exc)
            return str(exc)
        if worker.num_trials >= _TRIALS_PER_WORKER or self._closed:
            self._drop(worker)
            worker.kill()
        else:
            self._idle.put(worker)
        return problem

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        worker = _Worker(self.tokenizer_info, self.backend, self.memory_limit_mb)
        with self._workers_lock:
            self._workers.append(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        with self._workers_lock:
            if worker in self._workers:
                self._workers.remove(worker)

    def worker_pids(self) -> list[int]:
        with self._workers_lock:
            return [w.process.pid for w in self._workers if w.process.is_alive()]

    def shutdown(self) -> None:
        self._closed = True
        super().shutdown()
        with self._workers_lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()
