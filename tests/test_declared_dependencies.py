"""Every third-party package the runtime imports is one `pip install -e .` installs: declared in
pyproject's [project] dependencies (or a declared dependency's own, for FastAPI's pydantic,
starlette and anyio). The suite runs with the test extras installed, so an undeclared import
(pillow once was) would pass every other test and fail a user's plain install."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sglang_like", "frontend_dsl", "radix_cache", "constrained",
            "kernels/sglang_like_kernels")
OURS = {"sglang_like", "frontend_dsl", "radix_cache", "constrained", "sglang_like_kernels",
        "__future__"}
# what a declared dependency brings and promises: FastAPI is built on these
THROUGH_DECLARED = {"pydantic": "fastapi", "starlette": "fastapi", "anyio": "fastapi"}
# imported lazily by a feature that says how to install it
OPTIONAL = {"mooncake": "prefill/decode disaggregation's transfer engine (test extras)"}


def _third_party_imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {_norm(re.split(r"[<>=;\[ ~!]", d)[0]) for d in deps}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def test_every_runtime_import_is_a_declared_dependency() -> None:
    declared = _declared()
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _third_party_imports().items():
        if module in OPTIONAL or THROUGH_DECLARED.get(module) in declared:
            continue
        if not any(_norm(d) in declared for d in dists.get(module, [module])):
            missing[module] = where
    assert not missing, f"imported but not in [project] dependencies: {missing}"
