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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Both sets start at once: each is one single-threaded process (the interpreter in
    Python, the compiles in LLVM), so on 2 cores they take the longer one's time, not the
    sum (85 s + 134 s one after the other in CI)."""
    procs = {}
    for name, files, interpret in RUNS:
        tmp = tmp_path_factory.mktemp(name)
        env = {
            **os.environ,
            "TRITON_INTERPRET": interpret,
            "TRITON_CACHE_DIR": str(tmp / "triton-cache"),  # a real compile, not a cache hit
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += [str(HERE / f) for f in files]
        with open(tmp / "output.txt", "w") as out:  # a file: neither run waits on a pipe
            procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                            stderr=subprocess.STDOUT), tmp / "output.txt")
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_case_files_pass(name: str, runs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    proc, output = runs[name]
    try:
        proc.wait(timeout=800)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = output.read_text()
    report = stdout[-13000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) > 0, report
    assert not re.search(r"\d+ (failed|skipped|error)", stdout), report
