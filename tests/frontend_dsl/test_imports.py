"""frontend_dsl imports without torch and never imports sglang_like at module level."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import frontend_dsl

ROOT = pathlib.Path(frontend_dsl.__file__).parent


def test_imports_with_torch_blocked() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import frontend_dsl\n"
        "from frontend_dsl import *\n"
        "assert 'sglang_like' not in sys.modules, 'sglang_like was imported'\n"
        "print(len(frontend_dsl.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(frontend_dsl.__all__)


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Imports outside any function body (inside functions they are lazy)."""
    names: list[str] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        stack += list(ast.iter_child_nodes(node))
    return names


def test_no_module_level_import_of_the_runtime() -> None:
    forbidden = ("sglang_like", "torch", "radix_cache", "constrained", "kernels")
    for path in ROOT.rglob("*.py"):
        for name in _module_level_imports(ast.parse(path.read_text())):
            assert name.split(".")[0] not in forbidden, f"{path}: imports {name}"


def test_public_names_are_documented() -> None:
    for name in frontend_dsl.__all__:
        assert getattr(frontend_dsl, name).__doc__, name
