"""SGLang's own test programs (`sglang/test/test_programs.py` of the pinned `sglang` package) run
on our DSL, in-process and over HTTP.

The file is read from the installed package at test time (never copied here) and rewritten
with `ast` before it runs:

* imports: `import sglang as sgl` -> `import sglang_like as sgl`, `sglang.lang.*` ->
  `sglang_like.lang.*`; the two runtime helpers the programs use get stand-ins
  (`sglang.srt.utils.is_hip` -> False; `hf_transformers_utils.get_tokenizer(path)` -> our
  tokenizer of that model). Any other `sglang.*` import fails the test (the table is out of date).
* answer asserts: the default model is a 135M one, so asserts on what the answer says are
  recorded and printed, not enforced. Programs with a `check_answer` flag get
  `check_answer=False`; for the rest, ANSWER_ASSERTS names each answer-quality assert:
    - few_shot_qa: "washington" / ["tokyo", "london", "beijing"] (facts)
    - decode_int: hours == 24, days == 365 (facts; `int(...)` of the value still runs, so a
      non-integer fails)
    - tool_use: int(answer) == 257 * 983 (whether the model wrote the right expression; the
      expression is still evaluated and `int()` of the result still runs)
    - react: "finland" or "states" in the answer (facts)
    - completion_speculative: speculation used fewer prompt tokens. It does only when the
      model's free text keeps the program's "Name:/Birthday:/Job:" lines, so that the one
      speculated call covers the later gens; at the default temperature 1.0 the 135M model
      often writes something else, and then both runs make the same three calls. The
      mechanism itself is asserted with a scripted backend in test_sglang_compat_unit.py.
  Every other assert is structural (message counts, JSON that parses with typed fields, regex
  matches, streamed chunk/logprob counts, min_tokens) and must pass, as must every program
  run without raising.
* length: every unconstrained gen is capped at CAP_TOKENS new tokens (never below its
  min_tokens; constrained gens keep theirs) so the file runs in about half a minute per
  backend; PROGRAM_CAPS lifts it where a program's assert needs longer output.
* sampling: a gen that sets no seed gets SEED, so programs sampled at temperature > 0 (most
  run at the default 1.0) give the same text on every run and the asserts do not flake.

Programs not run, with the reason, are in NOT_RUN (found by their use of `sgl.image`/`video`).
The count of programs run and passed is printed per backend.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import pathlib
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest

import sglang_like as sgl
from frontend_dsl.backends.base import Backend, TokenUsage
from frontend_dsl.ir import GenParams

pytestmark = pytest.mark.slow

CAP_TOKENS = 16
SEED = 0
# room for the one speculated call to cover its three short lines; min_tokens as written
# (64 to 128): capped at 64 the gen stops at exactly its minimum, and the program counts the
# answer's tokens by encoding its text again, where one pair of sampled tokens that the
# tokenizer writes as one (a non-canonical split, at temperature 1.0) counts 63
PROGRAM_CAPS = {"test_completion_speculative": 40, "test_gen_min_new_tokens": 128}
ANSWER_ASSERTS: dict[str, tuple[str, ...]] = {
    "test_few_shot_qa": ("'washington' in", "answers == ["),
    "test_decode_int": ("== 24", "== 365"),
    "test_tool_use": ("== lhs * rhs",),
    "test_react": ("'finland' in answer",),
    "test_completion_speculative": ("usage_with_spec < usage_with_no_spec",),
}
NEEDS_MEDIA = ("image", "video")
_STANDINS = "_sglang_program_standins"


def _import_target(module: str) -> str:
    if module == "sglang":
        return "sglang_like"
    if module.startswith("sglang.lang."):
        return "sglang_like." + module[len("sglang."):]
    if module in ("sglang.srt.utils", "sglang.srt.utils.hf_transformers_utils"):
        return _STANDINS
    raise AssertionError(f"test_programs.py imports {module}: add it to the import table")


class _Rewrite(ast.NodeTransformer):
    """Point sglang imports at ours; turn the named answer asserts into recorded checks."""

    def __init__(self) -> None:
        self.function: str | None = None
        self.matched: dict[str, list[str]] = {name: [] for name in ANSWER_ASSERTS}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        outer = self.function
        if outer is None:
            self.function = node.name
        self.generic_visit(node)
        self.function = outer
        return node

    def visit_Import(self, node: ast.Import) -> ast.AST:
        for alias in node.names:
            if alias.name.split(".")[0] == "sglang":
                alias.name = _import_target(alias.name)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.module and node.module.split(".")[0] == "sglang":
            node.module = _import_target(node.module)
        return node

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        source = ast.unparse(node.test)
        for pattern in ANSWER_ASSERTS.get(self.function or "", ()):
            if pattern in source:
                self.matched[self.function].append(pattern)
                call = ast.Call(ast.Name("_answer_check", ast.Load()),
                                [node.test, ast.Constant(f"{self.function}: {source}")], [])
                return ast.copy_location(ast.Expr(call), node)
        return node


def _standins() -> types.ModuleType:
    def get_tokenizer(model_path: str) -> Any:
        from sglang_like.model_loader import load_tokenizer

        # our server names the built-in default model "default"
        return load_tokenizer(None if model_path in ("", "default") else model_path)

    module = types.ModuleType(_STANDINS)
    module.is_hip = lambda: False
    module.get_tokenizer = get_tokenizer
    return module


@dataclasses.dataclass
class Programs:
    """The rewritten file's namespace, its test functions and the answer checks they made."""

    namespace: dict[str, Any]
    names: list[str]
    not_run: dict[str, str]
    answer_checks: list[tuple[str, bool]]


def load_programs() -> Programs:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    assert spec is not None and spec.origin, "the pinned sglang package is not installed"
    path = pathlib.Path(spec.origin).parent / "test" / "test_programs.py"
    tree = ast.parse(path.read_text(), str(path))
    rewrite = _Rewrite()
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    for function, patterns in ANSWER_ASSERTS.items():
        assert sorted(rewrite.matched[function]) == sorted(patterns), (
            f"{function}: answer asserts {patterns} found as {rewrite.matched[function]}")
    checks: list[tuple[str, bool]] = []
    namespace: dict[str, Any] = {
        "__name__": "sglang_test_programs",
        "_answer_check": lambda ok, label: checks.append((label, bool(ok))),
    }
    sys.modules[_STANDINS] = _standins()
    exec(compile(tree, str(path), "exec"), namespace)  # noqa: S102 - the pinned package's file
    names, not_run = [], {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            media = sorted({n.attr for n in ast.walk(node)
                            if isinstance(n, ast.Attribute) and n.attr in NEEDS_MEDIA})
            if media:
                not_run[node.name] = f"needs {'/'.join(media)} input (a vision model)"
            else:
                names.append(node.name)
    return Programs(namespace, names, not_run, checks)


class _ShortGens(Backend):
    """Forwards to `inner`, capping max_new_tokens of unconstrained gens and seeding sampling
    (see the module docstring)."""

    def __init__(self, inner: Backend, cap: int) -> None:
        self.inner, self.cap = inner, cap
        self.chat_template = inner.chat_template

    def _short(self, params: GenParams) -> GenParams:
        params = dataclasses.replace(params, seed=SEED if params.seed is None else params.seed)
        if params.regex is not None or params.json_schema is not None or params.dtype:
            return params
        cap = max(self.cap, params.min_new_tokens or 0)
        return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens or cap, cap))

    def generate(self, prompt: str, params: GenParams) -> tuple[str, dict[str, Any]]:
        return self.inner.generate(prompt, self._short(params))

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, dict]]:
        return self.inner.generate_stream(prompt, self._short(params))

    def select(self, prompt: str, choices: list[str], temperature: float,
               method: str) -> tuple[str, dict[str, Any]]:
        return self.inner.select(prompt, choices, temperature, method)

    def cache_prefix(self, prefix: str) -> None:
        self.inner.cache_prefix(prefix)

    @property
    def token_usage(self) -> TokenUsage:
        return self.inner.token_usage

    def __getattr__(self, name: str) -> Any:  # get_model_name, get_tokenizer, ...
        return getattr(self.inner, name)


class Result(NamedTuple):
    """One program's outcome: None or the error it raised, and its wall time."""

    error: str | None
    elapsed_s: float


def run_all(programs: Programs, backend: Backend) -> dict[str, Result]:
    """Run every program on `backend` (as the default backend)."""
    results: dict[str, Result] = {}
    try:
        for name in programs.names:
            func: Callable = programs.namespace[name]
            kwargs = ({"check_answer": False}
                      if "check_answer" in inspect.signature(func).parameters else {})
            sgl.set_default_backend(_ShortGens(backend, PROGRAM_CAPS.get(name, CAP_TOKENS)))
            start, error = time.monotonic(), None
            try:
                func(**kwargs)
            except Exception as e:  # noqa: BLE001 - counted and reported below
                where = traceback.extract_tb(e.__traceback__)[-1]
                error = f"{type(e).__name__}: {e} (line {where.lineno})"
            results[name] = Result(error, time.monotonic() - start)
    finally:
        sgl.set_default_backend(None)
    return results


def _report(label: str, programs: Programs, results: dict[str, Result],
            elapsed_s: float) -> str:
    passed = [n for n, r in results.items() if r.error is None]
    lines = [f"sglang test_programs.py on {label}: {len(passed)}/{len(results)} programs "
             f"passed in {elapsed_s:.1f} s"]
    lines += [f"  {'ok' if r.error is None else 'FAILED'} {n} ({r.elapsed_s:.1f} s)"
              + (f": {r.error}" if r.error else "") for n, r in results.items()]
    lines += [f"  not run {n}: {why}" for n, why in programs.not_run.items()]
    lines += [f"  answer check {'ok' if ok else 'wrong'}: {what}"
              for what, ok in programs.answer_checks]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def programs() -> Programs:
    return load_programs()


@pytest.fixture(params=["in-process", "http"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "in-process":
        b: Backend = sgl.Runtime(engine=request.getfixturevalue("engine"))
    else:
        b = sgl.RuntimeEndpoint(request.getfixturevalue("server_url"))
    yield b
    b.shutdown()


def test_the_file_loads_and_names_what_is_not_run(programs: Programs) -> None:
    assert len(programs.names) >= 17, programs.names
    assert programs.not_run == {"test_image_qa": "needs image input (a vision model)"}
    assert {"test_parallel_encoding", "test_dtype_gen", "test_decode_json_regex",
            "test_completion_speculative"} <= set(programs.names)


def test_every_program_passes(programs: Programs, backend: Backend, request: Any,
                              capsys: pytest.CaptureFixture) -> None:
    programs.answer_checks.clear()
    start = time.monotonic()
    results = run_all(programs, backend)
    report = _report(request.node.callspec.params["backend"], programs, results,
                     time.monotonic() - start)
    with capsys.disabled():
        print("\n" + report)
    assert len(results) == len(programs.names)
    assert all(r.error is None for r in results.values()), report
