"""SglFunction: a decorated program with run / run_batch / bind / trace."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend_dsl.chat_template import chatml_template
from frontend_dsl.global_config import _backend_or_default, get_default_backend
from frontend_dsl.interpreter import StreamExecutor
from frontend_dsl.ir import DEFAULT_GEN_PARAMS, GenParams
from frontend_dsl.state import ProgramState

_RUN_DEFAULT_NAMES = (
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed",
    "ignore_eos", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs",
)


class SglFunction:
    """A generation program `def prog(s, *args)`; call it or `.run()` it to execute."""

    def __init__(self, func: Callable, bind_arguments: dict[str, Any] | None = None,
                 num_api_spec_tokens: int | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise ValueError("a program needs the state `s` as its first parameter")
        self.arg_names = [p.name for p in params[1:]]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise ValueError(f"bind: {self.__name__} has no argument(s) {unknown}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs},
                           self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Any = None,
            **kwargs: Any) -> ProgramState:
        """Execute once; returns the state (immediately when stream=True)."""
        defaults, kwargs = _split_defaults(kwargs)
        backend = _backend_or_default(backend)
        return run_program(self, backend, args, kwargs, defaults, stream, raise_error=True)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **kwargs: Any,
    ) -> list[ProgramState]:
        """Run over many argument dicts concurrently; results keep the input order.

        The program's static prefix (found by trace()) is sent once first with
        max_new_tokens=0 so the runtime's radix cache holds it for every item.
        """
        defaults, extra = _split_defaults(kwargs)
        if extra:
            raise ValueError(f"run_batch: unknown keyword(s) {sorted(extra)}")
        if not isinstance(batch_kwargs, list) or not all(isinstance(b, dict) for b in batch_kwargs):
            raise ValueError("run_batch takes a list of argument dicts")
        if not batch_kwargs:
            return []
        backend = _backend_or_default(backend)
        if len(batch_kwargs) > 1:
            self._warm_prefix(backend, batch_kwargs)
        if num_threads == "auto":
            num_threads = max(1, min(64, len(batch_kwargs), 4 * (os.cpu_count() or 1) + 8))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or a positive integer, not {num_threads}")

        def one(kw: dict[str, Any]) -> ProgramState:
            return run_program(self, backend, (), kw, defaults, False, raise_error=False)

        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            if progress_bar:
                from tqdm import tqdm

                for _ in tqdm(futures, total=len(futures), desc=self.__name__):
                    _.result()
            return [f.result() for f in futures]

    def _warm_prefix(self, backend: Any, batch_kwargs: list[dict[str, Any]]) -> str:
        """Arguments equal across the whole batch are static; the rest become placeholders."""
        first = batch_kwargs[0]
        constant = {k: v for k, v in first.items()
                    if all(k in b and b[k] == v for b in batch_kwargs[1:])}
        try:
            prefix = self.trace(backend=backend, **constant).static_prefix
        except Exception:  # noqa: BLE001 - a program trace() cannot follow just gets no warm-up
            return ""
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """Run symbolically (no model): returns a TracedProgram with the program's structure."""
        from frontend_dsl.tracer import trace_program

        backend = backend if backend is not None else get_default_backend()
        template = backend.chat_template if backend is not None else chatml_template()
        return trace_program(self, template, kwargs)


def _split_defaults(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    """Pull run-level sampling defaults (max_new_tokens=, temperature=, ...) out of kwargs."""
    chosen = {k: kwargs.pop(k) for k in _RUN_DEFAULT_NAMES if k in kwargs}
    if "stop" in chosen and isinstance(chosen["stop"], tuple):
        chosen["stop"] = list(chosen["stop"])
    return GenParams(**chosen).merged_with(DEFAULT_GEN_PARAMS), kwargs


def _bind_args(program: SglFunction, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(program.arg_names):
        raise ValueError(f"{program.__name__} takes {len(program.arg_names)} arguments")
    positional = dict(zip(program.arg_names, args, strict=False))
    bound = {**program.bind_arguments, **positional, **kwargs}
    unknown = [k for k in bound if k not in program.arg_names]
    if unknown and not _has_var_kwargs(program.func):
        raise ValueError(f"{program.__name__} got unexpected argument(s) {unknown}")
    return bound


def _has_var_kwargs(func: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())


def run_program(
    program: SglFunction, backend: Any, args: tuple, kwargs: dict[str, Any],
    defaults: GenParams, stream: bool, raise_error: bool,
) -> ProgramState:
    """Execute `program` on a fresh executor; waits for completion unless stream=True."""
    bound = _bind_args(program, args, kwargs)
    executor = StreamExecutor(backend, defaults, backend.chat_template, stream,
                              program.num_api_spec_tokens)
    state = ProgramState(executor)
    try:
        state.ret_value = program.func(state, **bound)
    except BaseException as e:
        executor.end()
        if raise_error:
            raise
        executor.error_ = e
        return state
    executor.end()
    if not stream:
        executor.sync()
        if raise_error:
            executor.raise_error()
    return state
