"""StreamExecutor: runs a program's expressions in order on a worker thread against a backend.

The program function runs in the caller's thread and only enqueues expressions (`s += ...`);
reads (`s["x"]`, `s.text()`) wait for the queue to drain. Each fork branch has its own
executor and thread, so branches issue their requests concurrently and the runtime batches them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from frontend_dsl.chat_template import ChatTemplate
from frontend_dsl.ir import (
    Concat,
    Expr,
    Gen,
    GenParams,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)
from frontend_dsl.speculative import ApiSpeculation, is_speculable


class _Join(Expr):
    """Internal: merge fork branches back into this executor (runs in order on the worker)."""

    def __init__(self, branches: list[StreamExecutor], mode: str) -> None:
        self.branches, self.mode = branches, mode


class StreamExecutor:
    """The mutable state of one running program: text, messages, variables and its worker."""

    def __init__(
        self, backend: Any, default_params: GenParams, chat_template: ChatTemplate,
        stream: bool = False, num_api_spec_tokens: int | None = None,
    ) -> None:
        self.backend = backend
        self.default_params = default_params
        self.chat_template = chat_template
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.images_: list[Any] = []  # sgl.image sources so far, sent with every later call
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.tools_by_var: dict[str, list[Any]] = {}  # tools of the tools= gen that set a var
        self.new_var_names: list[str] = []  # assigned here (not inherited), for join
        self.nodes: list[tuple] = []  # the structure actually executed (trace)
        self.cur_role: str | None = None
        self.cur_role_start = 0
        self.var_scope_starts: dict[str, int] = {}
        self.streaming_vars: dict[str, str] = {}  # partial values of gens being streamed
        self.stream_chunks: dict[str, list[tuple[str, dict]]] = {}  # (delta, meta) per chunk
        self.error_: BaseException | None = None
        self.is_finished = False
        self.children: list[StreamExecutor] = []
        self.num_api_spec_tokens = num_api_spec_tokens
        self.spec = None if num_api_spec_tokens is None or getattr(
            backend, "is_chat_model", False) else ApiSpeculation(num_api_spec_tokens)
        self._cond = threading.Condition()
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, daemon=True)
        self._worker.start()

    # ---- queue --------------------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        if self.is_finished:
            raise ValueError("this program state has ended; cannot append to it")
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait until every submitted expression has run."""
        self._queue.join()

    def end(self) -> None:
        """No more expressions; the worker exits after the pending ones (children too)."""
        if not self.is_finished:
            self.is_finished = True
            self._queue.put(None)
        for child in self.children:
            child.end()

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    break
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as e:  # noqa: BLE001 - stored, re-raised to the reader
                self.error_ = e
            finally:
                self._queue.task_done()
                with self._cond:
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # ---- dispatch -----------------------------------------------------------------------------
    def _execute(self, expr: Expr) -> None:
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            raise ValueError(f"unknown expression {type(expr).__name__}")
        handler(self, expr)

    def _exec_concat(self, expr: Concat) -> None:
        for item in expr.items:
            self._execute(item)

    def _exec_text(self, expr: Text) -> None:
        self.nodes.append(("text", expr.value))
        self._fill(expr.value)

    def _exec_image(self, expr: Image) -> None:
        if not getattr(self.backend, "takes_images", False):
            raise ValueError(f"the {type(self.backend).__name__} backend takes no images "
                             "(sgl.image): use Runtime or RuntimeEndpoint")
        self.nodes.append(("image",))
        self.images_.append(expr.source)
        self._append(getattr(self.backend, "image_placeholder", "<image>"))

    def _images(self) -> dict[str, Any]:
        """The backend call's images keyword: present only once the prompt has an image."""
        return {"images": list(self.images_)} if self.images_ else {}

    def _exec_gen(self, expr: Gen) -> None:
        params = expr.params.merged_with(self.default_params)
        self.nodes.append(("gen", expr.name, params))
        if (self.spec is not None and not self.stream and is_speculable(params)
                and not self.images_):
            value, meta = self.spec.gen(self.backend, self.text_, params)
            self._append(value)
        elif self.stream:
            if self.spec is not None:
                self.spec.drop()
            value, meta = "", {}
            if expr.name is not None:
                self.streaming_vars[expr.name] = ""
                self.stream_chunks[expr.name] = []
            for delta, chunk_meta in self.backend.generate_stream(self.text_, params,
                                                                  **self._images()):
                value, meta = value + delta, chunk_meta
                if expr.name is not None:
                    self.streaming_vars[expr.name] = value
                    self.stream_chunks[expr.name].append((delta, chunk_meta))
                self._append(delta)
        else:
            if self.spec is not None:
                self.spec.drop()
            value, meta = self.backend.generate(self.text_, params, **self._images())
            self._append(value)
        if expr.name is not None:
            if expr.tools is not None:
                self.tools_by_var[expr.name] = expr.tools
            self._set_var(expr.name, value, meta)
            with self._cond:  # readers of the stream see it end now, not at their next poll
                self.streaming_vars.pop(expr.name, None)
                self._cond.notify_all()

    def _exec_select(self, expr: Select) -> None:
        self.nodes.append(("select", expr.name, list(expr.choices)))
        if self.spec is not None:
            self.spec.drop()
        choice, meta = self.backend.select(
            self.text_, expr.choices, expr.temperature, expr.choices_method, **self._images())
        self._append(choice)
        if expr.name is not None:
            self._set_var(expr.name, choice, meta)

    def _exec_role_begin(self, expr: RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"cannot open role {expr.role!r} inside role {self.cur_role!r}")
        self.nodes.append(("role_begin", expr.role))
        if expr.role != "system" and not self.messages_ and self.chat_template.default_system:
            self._fill(self.chat_template.default_system)
        self._fill(self.chat_template.prefix(expr.role))
        self.cur_role, self.cur_role_start = expr.role, len(self.text_)

    def _exec_role_end(self, expr: RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"role_end({expr.role!r}) without a matching role_begin")
        self.nodes.append(("role_end", expr.role))
        content = self.text_[self.cur_role_start:]
        self._fill(self.chat_template.suffix(expr.role))
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None

    def _exec_scope_begin(self, expr: VarScopeBegin) -> None:
        self.nodes.append(("var_scope_begin", expr.name))
        self.var_scope_starts[expr.name] = len(self.text_)

    def _exec_scope_end(self, expr: VarScopeEnd) -> None:
        self.nodes.append(("var_scope_end", expr.name))
        start = self.var_scope_starts.pop(expr.name)
        self._set_var(expr.name, self.text_[start:], None)

    def _exec_join(self, expr: _Join) -> None:
        for branch in expr.branches:
            branch.sync()
            if branch.error_ is not None:
                raise branch.error_
        self.nodes.append(("join", expr.mode))
        if expr.mode == "concate_and_append":
            for branch in expr.branches:
                self._fill(branch.text_[branch.fork_start:])
            return
        names: list[str] = []
        for branch in expr.branches:
            names += [n for n in branch.new_var_names if n not in names]
        for name in names:
            values = [b.variables.get(name) for b in expr.branches]
            metas = [b.meta_info.get(name) for b in expr.branches]
            self._set_var(name, values, metas)

    # ---- state changes ------------------------------------------------------------------------
    def _fill(self, text: str) -> None:
        """Append text the program wrote (not the model): speculation checks it first."""
        if self.spec is not None:
            self.spec.fill(text)
        self._append(text)

    def _append(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def _set_var(self, name: str, value: Any, meta: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            if name not in self.new_var_names:
                self.new_var_names.append(name)
            self._cond.notify_all()

    # ---- reads --------------------------------------------------------------------------------
    def get_var(self, name: str) -> Any:
        self.sync()
        self.raise_error()
        if name not in self.variables:
            raise KeyError(f"no variable {name!r}; known: {sorted(self.variables)}")
        return self.variables[name]

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise self.error_

    def fork(self, size: int) -> list[StreamExecutor]:
        """Branches that start from this state's text, messages and variables."""
        self.sync()
        self.raise_error()
        if size > 1 and self.text_:
            self.backend.cache_prefix(self.text_, **self._images())  # branches share its KV
        branches = []
        for _ in range(size):
            b = StreamExecutor(self.backend, self.default_params, self.chat_template, self.stream,
                               self.num_api_spec_tokens)
            b.text_, b.messages_ = self.text_, list(self.messages_)
            b.images_ = list(self.images_)
            b.variables, b.meta_info = dict(self.variables), dict(self.meta_info)
            b.tools_by_var = dict(self.tools_by_var)
            b.cur_role, b.cur_role_start = self.cur_role, self.cur_role_start
            b.var_scope_starts = dict(self.var_scope_starts)
            b.fork_start = len(self.text_)
            branches.append(b)
        self.children += branches
        self.nodes.append(("fork", size, [b.nodes for b in branches]))
        return branches

    def join(self, branches: list[StreamExecutor], mode: str) -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be gather_variable or concate_and_append, not {mode}")
        self.submit(_Join(branches, mode))
        for b in branches:
            b.end()

    def iter_text(self, var_name: str | None) -> Iterator[str]:
        """Yield new text of the whole state (or of one variable) as it is produced."""
        pos = 0
        while True:
            with self._cond:
                current, done = self._snapshot(var_name)
                while len(current) == pos and not done:
                    self._cond.wait(timeout=0.5)
                    current, done = self._snapshot(var_name)
            if len(current) > pos:
                yield current[pos:]
                pos = len(current)
            if done:
                self.raise_error()
                return

    def iter_chunks(self, var_name: str) -> Iterator[tuple[str, dict]]:
        """Yield (new text, meta_info) of a streamed gen; a chunk with no text (a token still
        being decoded) is merged into the next one, so every piece yielded has text."""
        pos, pending = 0, None
        while True:
            with self._cond:
                chunks, done = self._chunk_snapshot(var_name)
                while len(chunks) == pos and not done:
                    self._cond.wait(timeout=0.5)
                    chunks, done = self._chunk_snapshot(var_name)
                new, pos = chunks[pos:], len(chunks)
            for delta, meta in new:
                pending = merge_stream_meta(pending, delta, meta)
                if pending[0]:
                    yield pending
                    pending = None
            if done:
                self.raise_error()
                return

    def _chunk_snapshot(self, var_name: str) -> tuple[list[tuple[str, dict]], bool]:
        idle = self._queue.unfinished_tasks == 0
        stopped = self.error_ is not None or (self.is_finished and idle)
        chunks = self.stream_chunks.get(var_name, [])
        ended = var_name in self.stream_chunks and var_name not in self.streaming_vars
        return chunks, stopped or ended

    def _snapshot(self, var_name: str | None) -> tuple[str, bool]:
        idle = self._queue.unfinished_tasks == 0
        stopped = self.error_ is not None or (self.is_finished and idle)
        if var_name is None:
            return self.text_, stopped
        if var_name in self.streaming_vars:
            return self.streaming_vars[var_name], stopped
        if var_name in self.variables:
            return str(self.variables[var_name]), True
        return "", stopped


# meta_info keys a stream chunk carries for its own new tokens only (the rest are cumulative)
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs")


def merge_stream_meta(pending: tuple[str, dict] | None, delta: str,
                      meta: dict) -> tuple[str, dict]:
    """Fold chunk (delta, meta) onto a pending one: texts and incremental lists concatenate,
    cumulative fields (completion_tokens, ...) come from the later chunk."""
    if pending is None:
        return delta, meta
    merged = dict(meta)
    for key in INCREMENTAL_META_KEYS:
        if key in meta or key in pending[1]:
            merged[key] = list(pending[1].get(key) or []) + list(meta.get(key) or [])
    return pending[0] + delta, merged


StreamExecutor.fork_start = 0
_HANDLERS: dict[type, Callable[[StreamExecutor, Any], None]] = {
    Concat: StreamExecutor._exec_concat,
    Text: StreamExecutor._exec_text,
    Gen: StreamExecutor._exec_gen,
    Image: StreamExecutor._exec_image,
    Select: StreamExecutor._exec_select,
    RoleBegin: StreamExecutor._exec_role_begin,
    RoleEnd: StreamExecutor._exec_role_end,
    VarScopeBegin: StreamExecutor._exec_scope_begin,
    VarScopeEnd: StreamExecutor._exec_scope_end,
    _Join: StreamExecutor._exec_join,
}
