"""The tiny model gives the same tokens and logits with the torch references and with the
Triton kernels (interpreter), through the real Scheduler and ModelRunner; and the
SGLANG_LIKE_KERNELS switch that forces a backend.

Each run is its own process (cases_model.py): the backend switch is read once at import, and
TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sglang_like_kernels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED_PREFIX, CHUNK, MAX_NEW = 40, 8, 9  # as in cases_model.py
KERNEL_NAMES = ("store_kv", "decode_attention", "extend_attention")


def _start(mode: str, out: Path, tmp_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "SGLANG_LIKE_KERNELS": mode,
        "TRITON_INTERPRET": "1" if mode == "triton" else "0",
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
    }
    cmd = [sys.executable, str(HERE / "cases_model.py"), str(out)]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both runs, side by side (the interpreted one is the slow one)."""
    tmp_path = tmp_path_factory.mktemp("model_runs")
    procs = {m: _start(m, tmp_path / f"{m}.pt", tmp_path) for m in ("reference", "triton")}
    results = {}
    for mode, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{mode} run failed:\n{log[-6000:]}"
        results[mode] = torch.load(tmp_path / f"{mode}.pt")
    return results


def test_each_run_used_only_its_backend(runs: dict[str, dict]) -> None:
    ref, tri = runs["reference"], runs["triton"]
    assert ref["kernels_mode"] == "reference" and tri["kernels_mode"] == "triton"
    assert not ref["triton_imported"]
    for name in KERNEL_NAMES:
        assert ref["calls"].get(f"sglang_like_kernels.reference.{name}", 0) > 0, name
        assert tri["calls"].get(f"sglang_like_kernels.triton_ops.{name}", 0) > 0, name
        assert tri["calls"].get(f"sglang_like_kernels.reference.{name}", 0) == 0, name
    # the same forwards made the same kernel calls
    for name in KERNEL_NAMES:
        want = ref["calls"][f"sglang_like_kernels.reference.{name}"]
        assert tri["calls"][f"sglang_like_kernels.triton_ops.{name}"] == want, name


def test_the_run_covers_chunking_radix_reuse_and_cascade_decode(runs: dict[str, dict]) -> None:
    ref = runs["reference"]
    steps = ref["steps"]
    chunks = [s for s in steps if s["rids"] == ["a"]]
    assert len(chunks) >= 4 and all(s["extend_lens"] == [CHUNK] for s in chunks)
    assert [s["prefix_lens"][0] for s in chunks] == [CHUNK * i for i in range(len(chunks))]
    assert ref["cached_tokens"] == {"a": 0, "b": SHARED_PREFIX}
    decodes = [s for s in steps if s["extend_lens"] == [1, 1]]
    assert len(decodes) >= MAX_NEW - 2
    assert ref["calls"].get("sglang_like_kernels.reference._cascade_decode", 0) > 0
    assert {rid: len(ids) for rid, ids in ref["output_ids"].items()} == {"a": MAX_NEW, "b": MAX_NEW}
    # a model that always says the same thing would make the comparison weak
    assert len(set(ref["output_ids"]["a"] + ref["output_ids"]["b"])) > MAX_NEW


def test_triton_interpreted_equals_reference(runs: dict[str, dict]) -> None:
    ref, tri = runs["reference"], runs["triton"]
    assert tri["steps"] == ref["steps"]
    assert tri["output_ids"] == ref["output_ids"]
    assert len(tri["logits"]) == len(ref["logits"]) == len(ref["steps"])
    for i, (got, want) in enumerate(zip(tri["logits"], ref["logits"], strict=True)):
        assert want.shape[0] > 0, f"forward {i} returned no logits to compare"
        assert not want.isnan().any() and not got.isnan().any(), f"forward {i}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"forward {i}")


@pytest.mark.parametrize(
    "value,mode",
    [(None, "auto"), ("", "auto"), ("auto", "auto"), ("Triton", "triton"),
     (" reference ", "reference")],
)  # fmt: skip
def test_backend_switch_values(value: str | None, mode: str, monkeypatch) -> None:
    if value is None:
        monkeypatch.delenv("SGLANG_LIKE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_LIKE_KERNELS", value)
    assert sglang_like_kernels._read_mode() == mode


@pytest.mark.parametrize("value", ["cuda", "torch", "1"])
def test_backend_switch_rejects_unknown_values(value: str, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_LIKE_KERNELS", value)
    with pytest.raises(ValueError, match="SGLANG_LIKE_KERNELS"):
        sglang_like_kernels._read_mode()


def test_forced_reference_on_cpu_and_auto_on_cpu(monkeypatch) -> None:
    x = torch.zeros(1)
    for mode in ("auto", "reference"):
        monkeypatch.setattr(sglang_like_kernels, "_MODE", mode)
        assert sglang_like_kernels._backend(x) is sglang_like_kernels.reference
