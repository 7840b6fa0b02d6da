"""The parsing of llama.cpp's bench tools in benchmarks.common (a stand-in script prints what
llama-bench prints with `-o json`; the real binaries are measured by the benchmarks, not the
suite), the fall back to repacking off per figure, and bench_offline's ratios to the peer."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from benchmarks.common import _run_tool, llama_batched_bench, llama_bench, llama_bench_depths


def _fake_tool(folder: Path, name: str, body: str) -> None:
    """A stand-in `name` that logs its arguments, one run a line, then runs `body` (sh)."""
    script = folder / name
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'args'}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _fake_llama_bench(folder: Path, rows: list[dict], exit_code: int = 0) -> None:
    _fake_tool(folder, "llama-bench", f"cat <<'JSON'\n{json.dumps(rows)}\nJSON\nexit {exit_code}")


def _runs(folder: Path) -> list[list[str]]:
    return [line.split() for line in (folder / "args").read_text().splitlines()]


def test_llama_bench_depths_reads_each_depths_decode_rate(tmp_path: Path) -> None:
    _fake_tool(tmp_path, "llama-bench", """
for a in "$@"; do [ "$prev" = "-d" ] && d=$a; prev=$a; done
echo "[{\\"n_prompt\\": 0, \\"n_gen\\": 64, \\"n_depth\\": $d, \\"avg_ts\\": $d.5}]"
""")
    got = llama_bench_depths(str(tmp_path), "model.gguf", 2, [1024, 4096], 64)
    assert got == {"d1024_tok_s": 1024.5, "d4096_tok_s": 4096.5,
                   "paths": {"d1024_tok_s": "llama-bench", "d4096_tok_s": "llama-bench"}}
    runs = _runs(tmp_path)  # one run per depth, llama.cpp's defaults (repacking on)
    assert [r[r.index("-d") + 1] for r in runs] == ["1024", "4096"]
    assert all(r[r.index("-p") + 1] == "0" and "--repack" not in r for r in runs)


def test_llama_bench_depths_says_which_binary_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama-bench is not an executable"):
        llama_bench_depths(os.fspath(tmp_path), "model.gguf", 2, [4096], 64)


def test_llama_bench_repacks_off_only_for_the_figure_that_crashes(tmp_path: Path) -> None:
    """A prefill that dies of SIGILL with repacking on (llama.cpp's AMX matmul on some Xeon
    VMs) runs again with `--repack 0`; the batch-1 decode, which runs, keeps the default."""
    _fake_tool(tmp_path, "llama-bench", """
case "$*" in
  *"-p 1024"*"--repack 0"*) echo '[{"n_prompt": 1024, "n_gen": 0, "avg_ts": 350.0}]' ;;
  *"-p 1024"*) kill -ILL $$ ;;
  *) echo '[{"n_prompt": 0, "n_gen": 128, "avg_ts": 280.0}]' ;;
esac""")
    got = llama_bench(str(tmp_path), "model.gguf", 2, 1024, 128)
    assert got["b1_tok_s"] == 280.0 and got["prefill_tok_s"] == 350.0
    assert got["paths"] == {"b1_tok_s": "llama-bench", "prefill_tok_s": "llama-bench --repack 0"}
    assert len(_runs(tmp_path)) == 3  # decode; prefill; prefill without repacking


def test_llama_batched_bench_falls_back_per_batch_size(tmp_path: Path) -> None:
    _fake_tool(tmp_path, "llama-batched-bench", """
case "$*" in
  *"-npl 32"*"--no-repack"*) echo '{"pl": 32, "speed_tg": 276.0}' ;;
  *"-npl 32"*) kill -SEGV $$ ;;
  *) echo 'log line'; echo '{"pl": 8, "speed_tg": 190.0}' ;;
esac""")
    got = llama_batched_bench(str(tmp_path), "model.gguf", 2, [8, 32], 32, 32)
    assert got == {"b8_tok_s": 190.0, "b32_tok_s": 276.0,
                   "paths": {"b8_tok_s": "llama-batched-bench",
                             "b32_tok_s": "llama-batched-bench --no-repack"}}


def test_llama_bench_does_not_retry_a_failure_that_is_no_crash(tmp_path: Path) -> None:
    _fake_llama_bench(tmp_path, [], exit_code=1)
    with pytest.raises(RuntimeError, match=r"failed \(1\)"):
        llama_bench(str(tmp_path), "model.gguf", 2, 1024, 128)
    assert len(_runs(tmp_path)) == 1


def test_bench_offline_labels_each_peer_figure_with_its_path(capsys) -> None:
    from benchmarks.bench_offline import _median_row, print_table

    peer_runs = [{"b1_tok_s": b1, "b8_tok_s": 190.0, "prefill_tok_s": 350.0, "decode_mb": 96.0,
                  "paths": {"b1_tok_s": "llama-bench",
                            "b8_tok_s": "llama-batched-bench --no-repack",
                            "prefill_tok_s": "llama-bench --repack 0"}} for b1 in (280.0, 300.0)]
    peer = _median_row(peer_runs)
    assert peer["paths"]["b8_tok_s"] == "llama-batched-bench --no-repack"
    ours = {"format": "int4", "b1_tok_s": 360.0, "b8_tok_s": 1100.0, "prefill_tok_s": 2000.0,
            "decode_mb": 70.0}
    print_table([ours], peer, 20.0, [8], [])
    out = capsys.readouterr().out
    peer_line = next(line for line in out.splitlines() if line.startswith("llama.cpp GGUF"))
    assert "300.0*" not in peer_line and "300.0" in peer_line  # the median; repacking on
    assert "190.0*" in peer_line and "350.0*" in peer_line
    assert "llama.cpp paths: batch 1 by default (weight repacking on)" in out
    assert "batch 8 (llama-batched-bench --no-repack)" in out
    assert "prefill (llama-bench --repack 0)" in out
    ratios = out[out.index("ratio to llama.cpp"):]
    assert "b1 1.20x " in ratios + " " and "b8 5.79x*" in ratios


def test_bench_offline_ratio_is_the_median_of_each_rounds_own():
    from benchmarks.bench_offline import round_ratios

    ours = [{"b1_tok_s": 200.0, "b32_tok_s": 1000.0, "rss_mb": 400.0},
            {"b1_tok_s": 100.0, "b32_tok_s": 500.0, "rss_mb": 400.0},
            {"b1_tok_s": 150.0, "b32_tok_s": 1200.0, "rss_mb": 400.0}]
    theirs = [{"b1_tok_s": 100.0, "b32_tok_s": 250.0},
              {"b1_tok_s": 50.0, "b32_tok_s": 125.0},  # the machine slowed for both
              {"b1_tok_s": 100.0, "b32_tok_s": 400.0}]
    got = round_ratios(ours, theirs)
    assert got == {"b1_tok_s": 2.0, "b32_tok_s": 4.0}  # the ratio of the medians: b1 1.5x


def test_a_tools_peak_rss_is_its_own():
    """A child's peak RSS is the child's own, not the benchmark's: wait4's ru_maxrss also
    counted the memory map a child replaces at exec (this process's), so after a benchmark
    had built a 1B model every llama.cpp run read 2.4 GB."""
    grown = bytearray(400 * 2**20)  # this process's peak at least 400 MB
    grown[:: 4096] = b"x" * len(grown[:: 4096])
    _, small = _run_tool([sys.executable, "-c", "import time; time.sleep(0.3)"], 60)
    _, large = _run_tool([sys.executable, "-c",
                          "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * "
                          "len(b[::4096]); time.sleep(0.3)"], 60)
    assert small < 100, small
    assert 200 <= large < 300, large
    del grown
