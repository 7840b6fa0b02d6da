"""The parsing of llama.cpp's bench tools in benchmarks.common (a stand-in script prints what
llama-bench prints with `-o json`; the real binaries are measured by the benchmarks, not the
suite), and bench_offline's ratios to the peer."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.common import llama_bench_depths


def _fake_llama_bench(folder: Path, rows: list[dict], exit_code: int = 0) -> None:
    script = folder / "llama-bench"
    script.write_text("#!/bin/sh\n"
                      f"echo \"$@\" > {folder / 'args'}\n"
                      f"cat <<'JSON'\n{json.dumps(rows)}\nJSON\n"
                      f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_llama_bench_depths_reads_each_depths_decode_rate(tmp_path: Path) -> None:
    _fake_llama_bench(tmp_path, [
        {"n_prompt": 0, "n_gen": 64, "n_depth": 1024, "avg_ts": 87.4},
        {"n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": 44.6},
    ])
    got = llama_bench_depths(str(tmp_path), "model.gguf", 2, [1024, 4096], 64)
    assert got == {"d1024_tok_s": 87.4, "d4096_tok_s": 44.6}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-d") + 1] == "1024,4096" and args[args.index("-p") + 1] == "0"


def test_llama_bench_depths_says_which_binary_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama-bench is not an executable"):
        llama_bench_depths(os.fspath(tmp_path), "model.gguf", 2, [4096], 64)


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
