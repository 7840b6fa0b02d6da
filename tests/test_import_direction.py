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
    ("sglang_like", "import radix_cache\nfrom sglang_like_kernels import x\nimport frontend_dsl\n", []),
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
