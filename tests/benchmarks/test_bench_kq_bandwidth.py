"""bench_kq_bandwidth on a small matrix: every type and row count measured and written."""

from __future__ import annotations

import json

from benchmarks import bench_kq_bandwidth


def test_small_run_writes_every_figure(tmp_path, capsys) -> None:
    out = tmp_path / "kq.json"
    assert bench_kq_bandwidth.main(["--types", "Q8_0,Q4_0", "--rows", "1,2", "--weights",
                                    str(64 * 4096), "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["type"], r["rows"]) for r in data["results"]] == [
        ("Q8_0", 1), ("Q8_0", 2), ("Q4_0", 1), ("Q4_0", 2)]
    assert all(r["GBps"] > 0 and r["GOPS"] > 0 for r in data["results"])
    assert data["read_bandwidth_GBps"] > 0 and data["rows_n"] == 64
    assert "read bandwidth" in capsys.readouterr().out
