"""trace(): run a program symbolically (placeholder arguments, no model) to get its structure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from frontend_dsl.chat_template import ChatTemplate
from frontend_dsl.interpreter import StreamExecutor
from frontend_dsl.ir import DEFAULT_GEN_PARAMS, GenParams

MARK = "\x1e"  # starts every placeholder: text after the first one is not static


class _TraceArg(str):
    """A placeholder argument: a str whose value is a marker, so f-strings and `+` keep it."""


@dataclass
class TracedProgram:
    """What trace() returns: the executed nodes and the traced text (markers for the unknown).

    `nodes` holds ("text", s), ("gen", name, GenParams), ("select", name, choices),
    ("role_begin", role), ("role_end", role), ("var_scope_begin"/"var_scope_end", name),
    ("fork", n, [branch nodes...]), ("join", mode).
    """

    nodes: list[tuple]
    text: str

    @property
    def static_prefix(self) -> str:
        """The text every run starts with: everything before the first argument or gen."""
        cut = self.text.find(MARK)
        return self.text if cut < 0 else self.text[:cut]

    @property
    def gen_names(self) -> list[str | None]:
        return [n[1] for n in _walk(self.nodes) if n[0] in ("gen", "select")]

    def kinds(self) -> list[str]:
        """The node kinds in order (branches flattened after their fork)."""
        return [n[0] for n in _walk(self.nodes)]


def _walk(nodes: list[tuple]) -> Iterator[tuple]:
    for node in nodes:
        yield node
        if node[0] == "fork":
            for branch in node[2]:
                yield from _walk(branch)


class TraceBackend:
    """A backend that calls no model: generations come back as markers."""

    def __init__(self, chat_template: ChatTemplate) -> None:
        self.chat_template = chat_template

    def generate(self, prompt: str, params: GenParams) -> tuple[str, dict]:
        return f"{MARK}gen{MARK}", {}

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, dict]]:
        yield self.generate(prompt, params)

    def select(self, prompt: str, choices: list[str], temperature: float,
               method: str) -> tuple[str, dict]:
        return f"{MARK}select{MARK}", {}

    def cache_prefix(self, prefix: str) -> None:
        return None


def trace_program(program: Any, template: ChatTemplate, kwargs: dict[str, Any]) -> TracedProgram:
    """Run `program` with every unbound argument replaced by a placeholder."""
    bound = {**program.bind_arguments, **kwargs}
    args = {n: bound.get(n, _TraceArg(f"{MARK}arg:{n}{MARK}")) for n in program.arg_names}
    executor = StreamExecutor(TraceBackend(template), DEFAULT_GEN_PARAMS, template)
    from frontend_dsl.state import ProgramState

    state = ProgramState(executor)
    try:
        program.func(state, **args)
    finally:
        executor.end()
    executor.sync()
    executor.raise_error()
    return TracedProgram(executor.nodes, executor.text_)
