"""Runs the Triton case files, each set in a fresh Python process.

TRITON_INTERPRET is read when a kernel is decorated, so the interpreter checks and the
ahead-of-time compile checks (which need real JIT functions) cannot share a process with
each other or with any other test that imports triton.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

RUNS = [
    # test_window_softcap.py also runs in the main suite, on the torch references only
    ("interpreter", ["cases_interpret.py", "cases_tiny_stack.py", "test_window_softcap.py"], "1"),
    ("aot_compile", ["cases_aot.py"], "0"),
]


@pytest.mark.parametrize("files,interpret", [r[1:] for r in RUNS], ids=[r[0] for r in RUNS])
def test_case_files_pass(files: list[str], interpret: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": interpret,
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),  # a real compile, not a cache hit
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(HERE / f) for f in files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    report = proc.stdout[-10000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, report
    assert not re.search(r"\d+ (failed|skipped|error)", proc.stdout), report
