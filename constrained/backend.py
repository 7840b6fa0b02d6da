"""GrammarBackend: compile specs off the scheduler loop, cache the artifacts, apply a timeout."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from constrained.base import GRAMMAR_KINDS, Grammar, InvalidGrammar, TokenizerInfo

GRAMMAR_BACKENDS: tuple[str, ...] = ("xgrammar", "outlines")


class _Compiler(Protocol):
    name: str

    def supports(self, kind: str, spec: str) -> bool | str: ...

    def compile(self, kind: str, spec: str) -> Any: ...

    def new_grammar(self, compiled: Any) -> Grammar: ...


def _make_compiler(tokenizer_info: TokenizerInfo, backend: str, num_threads: int) -> _Compiler:
    if backend == "xgrammar":
        from constrained.xgrammar_backend import XGrammarCompiler

        return XGrammarCompiler(tokenizer_info, num_threads)
    if backend == "outlines":
        from constrained.outlines_backend import OutlinesCompiler

        return OutlinesCompiler(tokenizer_info)
    raise ValueError(f"unknown grammar backend {backend!r}; expected one of {GRAMMAR_BACKENDS}")


class GrammarBackend:
    """Turns (kind, spec) into a fresh per-request Grammar, or an InvalidGrammar value.

    Compiled artifacts are cached by (kind, spec) (LRU, `max_cache_entries`), failures
    included. Compiles run in a thread pool; a compile slower than `compile_timeout_s`
    resolves the request's future to InvalidGrammar (the compile itself cannot be
    interrupted and finishes in the background, filling the cache for later requests).
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        backend: str = "xgrammar",
        num_threads: int = 2,
        compile_timeout_s: float = 30.0,
        max_cache_entries: int = 512,
    ) -> None:
        if compile_timeout_s <= 0 or num_threads < 1 or max_cache_entries < 1:
            raise ValueError("compile_timeout_s, num_threads and max_cache_entries must be > 0")
        self.tokenizer_info = tokenizer_info
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        self._compiler = _make_compiler(tokenizer_info, backend, num_threads)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"grammar-{backend}")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._max_cache_entries = max_cache_entries
        self._lock = threading.Lock()

    def supports(self, kind: str, spec: str) -> bool | str:
        """True if this backend claims to enforce (kind, spec) exactly; else the reason why not.

        Cheap and static (no compile): a spec that is malformed still reports True here and
        fails at compile time with an InvalidGrammar message.
        """
        if kind not in GRAMMAR_KINDS:
            return f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}"
        return self._compiler.supports(kind, spec)

    def get_future(self, kind: str, spec: str) -> Future:
        """A future resolving to a fresh Grammar or an InvalidGrammar; it never raises."""
        result: Future = Future()
        reason = self.supports(kind, spec)
        if reason is not True:
            result.set_result(InvalidGrammar(f"{self.backend} backend: {reason}"))
            return result
        compiled = self._compiled_future(kind, spec)
        timer = threading.Timer(self.compile_timeout_s, self._on_timeout, (result, kind))
        timer.daemon = True
        compiled.add_done_callback(lambda done: self._on_compiled(done, result, timer))
        if not result.done():
            timer.start()
        return result

    def compile(self, kind: str, spec: str) -> Grammar | InvalidGrammar:
        """Blocking `get_future(kind, spec).result()`, with the same timeout."""
        return self.get_future(kind, spec).result()

    def cache_size(self) -> int:
        """Number of (kind, spec) entries held in the compile cache."""
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compiles are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiled_future(self, kind: str, spec: str) -> Future:
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._pool.submit(self._safe_compile, kind, spec)
            self._cache[key] = future
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)
            return future

    def _safe_compile(self, kind: str, spec: str) -> Any:
        try:
            return self._compiler.compile(kind, spec)
        except Exception as exc:  # noqa: BLE001 - any compiler failure ends one request only
            return InvalidGrammar(f"{self.backend} failed to compile {kind}: {exc!r}")

    def _on_compiled(self, done: Future, result: Future, timer: threading.Timer) -> None:
        timer.cancel()
        compiled = done.result()
        if isinstance(compiled, InvalidGrammar):
            value: Grammar | InvalidGrammar = compiled
        else:
            try:
                value = self._compiler.new_grammar(compiled)
            except Exception as exc:  # noqa: BLE001
                value = InvalidGrammar(f"{self.backend} failed to build a matcher: {exc!r}")
        _set_once(result, value)

    def _on_timeout(self, result: Future, kind: str) -> None:
        message = f"{kind} compile took longer than {self.compile_timeout_s:g}s ({self.backend})"
        _set_once(result, InvalidGrammar(message))


def _set_once(future: Future, value: Any) -> None:
    try:
        future.set_result(value)
    except Exception:  # noqa: BLE001 - already resolved by the other of compile / timeout
        pass
