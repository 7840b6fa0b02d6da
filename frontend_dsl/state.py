"""ProgramState (what a program's `s` is) and ProgramStateGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from frontend_dsl.interpreter import StreamExecutor
from frontend_dsl.ir import RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, _role, to_expr
from frontend_dsl.tools import ToolCall, parse_tool_call

_END = object()


class ProgramState:
    """The state `s` of a running program: `s += expr`, `s["var"]`, `s.text()`, roles, forks."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # ---- building -----------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(to_expr(other))
        return self

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block is also stored in variable `name`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self.stream_executor.submit(RoleBegin(role))
        yield
        self.stream_executor.submit(RoleEnd(role))

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._role_block(role)
        self += _role(role, expr)
        return None

    def system(self, expr: Any = None) -> Any:
        """`with s.system():` block, or append a system message when given `expr`."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        """`with s.user():` block, or append a user message when given `expr`."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """`with s.assistant():` block, or append an assistant message when given `expr`."""
        return self._role("assistant", expr)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` branches continuing from here; they run concurrently."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive integer, got {size!r}")
        branches = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(b) for b in branches], self)

    def copy(self) -> ProgramState:
        """An independent state with the same text, messages and variables."""
        (branch,) = self.stream_executor.fork(1)
        return ProgramState(branch)

    # ---- reading ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self.stream_executor._set_var(name, value, None)

    def __setitem__(self, name: str, value: Any) -> None:
        """`s["x"] = value` sets variable `x` (after everything appended so far has run)."""
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_meta_info(self, name: str) -> Any:
        """The backend's meta_info of the gen/select that set `name` (a list after a join)."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def tool_call(self, name: str) -> ToolCall:
        """The call a `gen(name, tools=...)` wrote, parsed: ToolCall(name, arguments)."""
        return parse_tool_call(self[name], self.stream_executor.tools_by_var.get(name))

    def text(self) -> str:
        self.sync()
        self.stream_executor.raise_error()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        self.stream_executor.raise_error()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        self.sync()
        return self.stream_executor.error_

    def text_iter(self, var_name: str | None = None,
                  return_meta_data: bool = False) -> Iterator[Any]:
        """New text as it is generated (of the whole state, or of one variable).

        With `return_meta_data=True` (needs `var_name`) it yields `(text, meta_info)` pairs:
        meta_info is the backend's for that piece, with `output_token_logprobs` of its tokens
        only. Without streaming, the one pair is the whole value and its meta_info.
        """
        if not return_meta_data:
            return self.stream_executor.iter_text(var_name)
        if var_name is None:
            raise ValueError("text_iter: return_meta_data=True needs a var_name")
        if not self.stream_executor.stream:
            return iter([(self[var_name], self.get_meta_info(var_name))])
        return self.stream_executor.iter_chunks(var_name)

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async form of text_iter; the blocking waits run in a worker thread."""
        it = self.text_iter(var_name, return_meta_data)
        while True:
            chunk = await asyncio.to_thread(next, it, _END)
            if chunk is _END:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork: index them, `forks += expr` appends to all, `join()` merges.

    `forks += [e0, e1, ...]` appends one expression per branch; `forks += lambda i: ...`
    appends what the function returns for each branch index.
    """

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("fork branches cannot be replaced; use forks[i] += ...")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other):  # forks += lambda i: ...: one expression per branch, by index
            other = [other(i) for i in range(len(self.states))]
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other, strict=False):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Merge into the parent: each branch variable becomes a list (or append the texts)."""
        self.parent.stream_executor.join([s.stream_executor for s in self.states], mode)
