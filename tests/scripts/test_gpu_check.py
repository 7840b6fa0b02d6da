"""scripts/gpu_check.py --cpu-smoke: every section of the device check runs on CPU (Triton
under the interpreter, tiny shapes) and passes, with its figures in the JSON; a section that
raises or runs past its time limit is reported failed, the others still run, and the exit
status says so.

The script runs in a subprocess: it sets TRITON_INTERPRET before triton is imported, which
cannot share a process with other tests (see tests/kernels/test_triton_kernels.py). Importing
it here is safe: at import it loads the standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GC = _load_script()
SECTIONS = list(GC.SECTION_NAMES)
N = len(SECTIONS)


def _run(tmp_path: Path, inject: str | None = None,
         *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != GC.INJECT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    if inject is not None:
        env[GC.INJECT_ENV] = inject
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc, data


def _report(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-8000:] + proc.stderr[-4000:]


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


def _figures_present(section: dict) -> None:
    """Each section's own figures, as many as its smoke plan asks for."""
    plan, figs, name = GC.PLAN_SMOKE, section["figures"], section["name"]
    shapes = [s.name for s in plan.bench_shapes]
    if name == "kernels":
        rows = figs["rows"]
        labels = " ".join(r["kernel"] for r in rows)
        for kernel in ("store_kv", "decode", "extend", "tree_verify", "masked", "bitmask"):
            assert kernel in labels, kernel
        for kv in ("int8", "fp8_e4m3"):  # quantized pools: store, decode, extend, verify
            assert sum(f"[{kv}]" in r["kernel"] for r in rows) == 4, kv
        assert all(r["ok"] and r["rel_err"] is not None and r["triton_ms"] > 0 for r in rows)
        assert figs["copy_bandwidth_GBps"] > 0
    elif name == "greedy":
        models = figs["models"]
        assert [m["shape"] for m in models] == [s.name for s in plan.equality_shapes]
        for m in models:
            assert m["ok"] and m["max_rel_logit_diff"] is not None
            assert [len(t) for t in m["device_tokens"]] == [plan.equality_new] * 2
    elif name == "throughput":
        steps = len(plan.decode_batches) + 1  # + prefill
        assert [r["shape"] for r in figs["rows"]] == [s for s in shapes for _ in range(steps)]
        for r in figs["rows"]:
            assert r["tok_s"] > 0 and r["bw_floor_ms"] > 0 and r["compute_floor_ms"] > 0
    elif name == "verify":
        assert figs["accept_lengths"] == [1.5, 2.0, 2.5, 3.0]
        assert [s["shape"] for s in figs["shapes"]] == shapes
        for s in figs["shapes"]:
            assert s["decode_ms"] > 0
            assert [v["rows"] for v in s["verify"]] == list(plan.verify_rows)
            for v in s["verify"]:  # a speed-up at every acceptance length the rows allow
                assert set(v["speedup"]) == {str(a) for a in figs["accept_lengths"]
                                             if a <= v["rows"]}
    elif name == "sampling":
        assert figs["greedy_equal"] == 10
        assert "syncs_per_sample" not in figs  # counted on CUDA only
        assert {k for k in figs if k.startswith("chi2")} == {
            "chi2 top_k 2", "chi2 top_p 0.75", "chi2 min_p 0.3"}
        assert all(figs[k] < 24.3 for k in figs if k.startswith("chi2"))
        assert figs["device_ms"] > 0 and figs["host_ms"] > 0
        assert figs["ahead_equal"] == 24 and figs["verify_sampled_equal"] is True
        assert "verify_max_syncs" not in figs
    elif name == "graphs":
        sizes = sorted({r for b in plan.decode_batches for r in (b, max(1, b - 1))})
        assert [(r["batch"], r["nodes"]) for r in figs["rows"]] == (
            [(n, 1) for n in sizes] + [(n, GC.GRAPH_VERIFY_NODES) for n in sizes if n <= 8])
        assert figs["buckets"] == [1, 2] and figs["capture_s"] > 0
        for r in figs["rows"]:  # EagerGraphs replays the same forward: the same logits
            assert r["max_rel_logit_diff"] == 0.0 and r["eager_ms"] > 0 and r["graph_ms"] > 0
    else:  # pragma: no cover - a new section needs its checks here
        raise AssertionError(f"no figure checks for section {name!r}")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    return _run(tmp_path_factory.mktemp("gpu_check"))


def test_cpu_smoke_runs_every_section_ok(smoke) -> None:
    proc, data = smoke
    assert proc.returncode == 0, _report(proc)
    assert _last_line(proc) == f"{N}/{N} sections ok", _report(proc)
    assert data["mode"] == "cpu-smoke" and data["summary"] == f"{N}/{N} sections ok"
    assert [s["name"] for s in data["sections"]] == SECTIONS
    for section in data["sections"]:
        assert section["ok"] and section["error"] is None, section
        assert section["seconds"] < section["limit_s"]
        # one table per section, its header saying the timings mean nothing here
        assert f"== {section['name']}: ok" in proc.stdout
        assert section["columns"] and section["rows"]
        _figures_present(section)
    assert proc.stdout.count("timings meaningless") == N


def test_a_section_that_raises_fails_alone_and_the_rest_still_run(tmp_path: Path) -> None:
    broken = "greedy"  # not the last: the sections after it must still run
    proc, data = _run(tmp_path, broken)
    assert proc.returncode != 0, _report(proc)
    assert _last_line(proc) == f"{N - 1}/{N} sections ok", _report(proc)
    assert [s["name"] for s in data["sections"]] == SECTIONS
    for section in data["sections"]:
        if section["name"] == broken:
            assert not section["ok"]
            assert "RuntimeError: failure injected" in section["error"]
            assert f"== {broken}: FAILED" in proc.stdout and "failure injected" in proc.stdout
        else:
            assert section["ok"], section
            _figures_present(section)


def test_a_section_past_its_time_limit_is_killed(tmp_path: Path, monkeypatch) -> None:
    """The parent's side, in this process: the child (forked, it sleeps and touches nothing
    else) is killed at its limit and reported failed."""
    monkeypatch.setenv(GC.INJECT_ENV, "verify:hang")
    args = GC.parse_args(["--cpu-smoke", "--sections", "verify"])
    result = GC.run_section("verify", args, limit=0.5)
    assert not result["ok"] and "time limit" in result["error"], result
    assert 0.5 <= result["seconds"] < 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_and_without_cpu_smoke_it_says_so_and_stops(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'kernels'}{os.pathsep}{ROOT}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, _report(proc)
    assert "no CUDA device here" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not out.exists()


def test_unknown_sections_and_time_limits_are_refused() -> None:
    for argv in (["--sections", "kernels,nope"], ["--time-limit", "kernels"],
                 ["--time-limit", "nope=3"]):
        with pytest.raises(SystemExit):
            GC.parse_args(argv)


def test_greedy_comparison_tells_a_near_tie_from_a_difference() -> None:
    want = torch.tensor([[5.0, 1.0, 0.0], [0.0, 3.0, 2.999]])
    noise = torch.tensor([[0.0, 0.0, 0.0], [0.0, -0.001, 0.001]])
    same = GC.compare_greedy([[0], [1]], [[0], [1]], [want], [want])
    assert same["ok"] and same["verdict"] == "yes" and same["max_rel_logit_diff"] == 0.0
    # request 1 took token 2 where the reference's two logits were 0.001 apart: a tie
    tie = GC.compare_greedy([[0], [2]], [[0], [1]], [want + noise], [want])
    assert tie["ok"] and tie["verdict"] == "tie@0" and tie["first_diff_step"] == 0
    # ... but 1.0 apart, with the paths' logits as close, it is a difference
    apart = torch.tensor([[5.0, 1.0, 0.0], [0.0, 3.0, 2.0]])
    differ = GC.compare_greedy([[0], [2]], [[0], [1]], [apart + noise], [apart])
    assert not differ["ok"] and differ["verdict"] == "NO"
    # the same tokens from logits far apart, or from NaNs, fail too
    far = GC.compare_greedy([[0], [1]], [[0], [1]], [want + 3 * noise * 100], [want])
    assert not far["ok"] and far["verdict"].startswith("NO (logits")
    nan = GC.compare_greedy([[0], [1]], [[0], [1]], [want * float("nan")], [want])
    assert not nan["ok"]
