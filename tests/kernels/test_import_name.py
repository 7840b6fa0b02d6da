"""The kernels' import name does not collide with the PyPI distribution `kernels`.

transformers >= 5.25 imports Hugging Face's `kernels` distribution (the test extra installs
it). This project's folder kernels/ is a plain folder holding the package `sglang_like_kernels`,
so from any working directory, the repository root included, `import kernels` is that
distribution and `import sglang_like_kernels` is ours.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, kernels, sglang_like_kernels, sglang_like_kernels.cpu
import transformers
from transformers import LlamaConfig
import sglang_like.models.llama
print(json.dumps({"kernels": kernels.__file__, "ours": sglang_like_kernels.__file__,
                  "cpu_source": str(sglang_like_kernels.cpu.__file__)}))
"""


def test_the_colliding_distribution_is_installed() -> None:
    dist = importlib.metadata.distribution("kernels")  # what transformers >= 5.25 requires
    assert dist.metadata["Name"] == "kernels"


@pytest.mark.parametrize("where", ["repository root", "elsewhere", "a script's folder"])
def test_both_import_right_from_any_directory(where: str, tmp_path: Path) -> None:
    if where == "a script's folder":  # sys.path[0] is the script's folder, not the root
        script = tmp_path / "probe.py"
        script.write_text(_PROBE)
        cmd, cwd = [sys.executable, str(script)], tmp_path
    else:
        cmd = [sys.executable, "-c", _PROBE]
        cwd = ROOT if where == "repository root" else tmp_path
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    dist_files = Path(importlib.metadata.distribution("kernels").locate_file("kernels"))
    assert Path(found["kernels"]).resolve().is_relative_to(dist_files.resolve())
    assert Path(found["ours"]).resolve() == ROOT / "kernels" / "sglang_like_kernels" / \
        "__init__.py"
    assert not (ROOT / "kernels" / "__init__.py").exists()
