"""Import direction between the five packages (docs/architecture.md, "Which way imports point").

Every module's imports are parsed with `ast`; an edge that points the wrong way fails. A
subprocess check then imports the torch-free packages with torch blocked.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sglang_like", "frontend_dsl", "radix_cache", "constrained", "sglang_like_kernels")

# package -> packages it may import anywhere / only inside a function (lazily)
ALLOWED: dict[str, set[str]] = {
    "sglang_like": {"frontend_dsl", "radix_cache", "constrained", "sglang_like_kernels"},
    "frontend_dsl": set(),
    "radix_cache": set(),
    "constrained": set(),
    "sglang_like_kernels": set(),
}
ALLOWED_LAZY: dict[str, set[str]] = {"frontend_dsl": {"sglang_like"}}


@dataclass(frozen=True)
class Edge:
    """One import statement: which file, which line, which package it reaches, how."""

    path: str
    line: int
    target: str
    is_lazy: bool  # inside a function body, or only under `if TYPE_CHECKING:`


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # a plain folder, not a package: see pyproject.toml
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, lazy: bool, out: list[tuple[ast.AST, bool]]) -> None:
    """Collect import nodes; `lazy` once inside a function or an `if TYPE_CHECKING:` body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append((child, lazy))
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                _walk(ast.Module(body=[stmt], type_ignores=[]), True, out)
            for stmt in child.orelse:
                _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, out)
        else:
            _walk(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)), out)


def import_edges(path: Path) -> list[Edge]:
    """Every import in `path` that reaches one of PACKAGES (its own package included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = _module_name(path)
    found: list[tuple[ast.AST, bool]] = []
    _walk(tree, False, found)
    edges = []
    for node, lazy in found:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = [_resolve(node, module, path.name == "__init__.py")]
        for name in names:
            top = name.split(".")[0]
            if top in PACKAGES:
                edges.append(Edge(str(path.relative_to(ROOT)), node.lineno, top, lazy))
    return edges


def _package_dir(package: str) -> Path:
    """Where a package's source lives (the kernels' under the plain folder kernels/)."""
    return ROOT / "kernels" / package if package == "sglang_like_kernels" else ROOT / package


def _package_files(package: str) -> list[Path]:
    return sorted(_package_dir(package).rglob("*.py"))


def violations(package: str, edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        if e.target == package or e.target in ALLOWED[package]:
            continue
        if e.is_lazy and e.target in ALLOWED_LAZY.get(package, set()):
            continue
        how = "inside a function" if e.is_lazy else "at module level"
        bad.append(f"{e.path}:{e.line}: {package} -> {e.target} ({how})")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_the_right_way(package: str) -> None:
    files = _package_files(package)
    assert files, f"no modules found for {package}"
    edges = [e for f in files for e in import_edges(f)]
    assert violations(package, edges) == []


# ---- the checker itself, on snippets (so the test above can fail) ------------------------
_SNIPPETS = [
    ("radix_cache", "import torch\nfrom sglang_like.req import Req\n", ["sglang_like"]),
    ("sglang_like_kernels", "def f():\n    import constrained\n", ["constrained"]),
    ("frontend_dsl", "from sglang_like import Engine\n", ["sglang_like"]),
    ("frontend_dsl", "def f():\n    from sglang_like.engine import Engine\n", []),
    ("frontend_dsl", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from sglang_like import Engine\n", []),
    ("frontend_dsl", "try:\n    import sglang_like\nexcept ImportError:\n    pass\n",
     ["sglang_like"]),
    ("frontend_dsl", "class A:\n    x = __import__('os')\n    import sglang_like_kernels\n",
     ["sglang_like_kernels"]),
    ("sglang_like", "import radix_cache\nfrom sglang_like_kernels import x\n"
                    "import frontend_dsl\n", []),
    ("constrained", "from . import backend\nfrom .masks import y\n", []),
]


@pytest.mark.parametrize(("package", "source", "expected_targets"), _SNIPPETS)
def test_checker_on_snippets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str,
                             source: str, expected_targets: list[str]) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg_dir = tmp_path / package
    pkg_dir.mkdir()
    path = pkg_dir / "mod.py"
    path.write_text(source, encoding="utf-8")
    bad = violations(package, import_edges(path))
    assert [b.split(" -> ")[1].split(" ")[0] for b in bad] == expected_targets


# ---- torch-free imports ------------------------------------------------------------------
_BLOCK_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import traceback
try:
    import {module}
except ImportError:
    traceback.print_exc()
    sys.exit(1)
"""


@pytest.mark.parametrize("module", ["frontend_dsl", "sglang_like", "radix_cache"])
def test_import_without_torch(module: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH.format(module=module)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"`import {module}` needs torch; the import chain:\n{proc.stderr[-3000:]}"
    )


# ---- inside sglang_like: layers, bottom to top ----------------------------------------
# A unit is a subpackage or a root module of sglang_like. A unit may import units of its own
# layer or below (circles are caught separately), never above.
SGLANG_LIKE_LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer.split()) for layer in (
    "config sampling_params req schedule_batch tokenizer detokenizer forward_batch mem_pool "
    "utils function_call",
    "layers multimodal",
    "models tp model_loader lora model_executor",
    "model_runner",
    "speculative",
    "scheduler",
    "disaggregation",
    "engine_core",
    "engine",
    "server",
    "launch_server launch_router bench_serving __main__ cli lang __init__",
))
MAX_ROOT_MODULES = 16
# imports that point up on purpose: (importing package, imported package), lazy only
ALLOWED_UPWARD = {("frontend_dsl", "sglang_like")}
TOOLS = ("benchmarks", "training", "scripts", "examples", "tests")


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in _package_files(package)}


def _resolve_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import names: itself, or its nearest enclosing module we have."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports (all of them: lazy and TYPE_CHECKING ones too); an
    allowed upward import left out."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: list[tuple[ast.AST, bool]] = []
        _walk(ast.parse(path.read_text(encoding="utf-8")), False, found)
        targets = set()
        for node, lazy in found:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:  # `from pkg import sub` reaches the submodule, else pkg itself
                base = _resolve(node, module, path.name == "__init__.py")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]
            for name in names:
                target = _resolve_module(name, modules)
                if target is None or target == module:
                    continue
                if lazy and (module.split(".")[0], target.split(".")[0]) in ALLOWED_UPWARD:
                    continue
                targets.add(target)
        edges[module] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "sglang_like":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(unit: str) -> int:
    for rank, layer in enumerate(SGLANG_LIKE_LAYERS):
        if unit in layer:
            return rank
    raise AssertionError(f"sglang_like.{unit} is in no layer: add it to SGLANG_LIKE_LAYERS")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        unit = _unit(module)
        if unit is None:
            continue
        for target in sorted(targets):
            other = _unit(target)
            if other is not None and _rank(other) > _rank(unit):
                bad.append(f"{module} -> {target} (layer {_rank(unit)} -> {_rank(other)})")
    return bad


def _unit_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in edges.items():
        unit = _unit(module)
        if unit is not None:
            units.setdefault(unit, set()).update(
                u for t in targets if (u := _unit(t)) is not None and u != unit)
    return units


def test_no_import_circles() -> None:
    """Between modules and between sglang_like's units, lazy imports counted."""
    edges = module_edges(_all_modules())
    assert circles(edges) == []
    assert circles(_unit_edges(edges)) == []


def test_sglang_like_imports_point_down() -> None:
    assert upward_imports(module_edges(_all_modules())) == []


def test_runtime_never_imports_the_tools() -> None:
    """Benchmarks, training and tests sit outside the runtime's import graph."""
    bad = [f"{e.path}:{e.line}" for package in PACKAGES for f in _package_files(package)
           for e in _tool_edges(f)]
    assert bad == []


def _tool_edges(path: Path) -> list[Edge]:
    found: list[tuple[ast.AST, bool]] = []
    _walk(ast.parse(path.read_text(encoding="utf-8")), False, found)
    edges = []
    for node, lazy in found:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if node.level == 0 else [])
        edges += [Edge(str(path.relative_to(ROOT)), node.lineno, n.split(".")[0], lazy)
                  for n in names if n.split(".")[0] in TOOLS]
    return edges


def test_a_few_modules_at_the_root_of_sglang_like() -> None:
    root = sorted(p.name for p in (ROOT / "sglang_like").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    assert {p.stem for p in (ROOT / "sglang_like").glob("*.py")} | {
        p.name for p in (ROOT / "sglang_like").iterdir() if (p / "__init__.py").exists()
    } <= set().union(*SGLANG_LIKE_LAYERS)


# ---- the checkers themselves, on graphs (so the tests above can fail) --------------------
@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}}, []),
])
def test_circle_finder(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(edges) == expected


def test_layer_checker_flags_an_upward_import() -> None:
    edges = {"sglang_like.req": {"sglang_like.speculative.controller"},
             "sglang_like.scheduler.scheduler": {"sglang_like.req"},
             "sglang_like.speculative.eagle": {"sglang_like.model_runner"}}
    assert upward_imports(edges) == [
        "sglang_like.req -> sglang_like.speculative.controller (layer 0 -> 4)"]


def test_module_edges_count_lazy_and_type_checking_imports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg = tmp_path / "sglang_like"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "req.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from sglang_like.scheduler import Scheduler\n")
    (pkg / "scheduler.py").write_text("def f():\n    from sglang_like import req\n")
    modules = {_module_name(p): p for p in sorted(pkg.glob("*.py"))}
    edges = module_edges(modules)
    assert edges["sglang_like.req"] == {"sglang_like.scheduler"}
    assert edges["sglang_like.scheduler"] == {"sglang_like.req"}
    assert circles(edges) == [["sglang_like.req", "sglang_like.scheduler"]]
