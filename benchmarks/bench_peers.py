"""llama.cpp as a peer in benchmarks: its own bench tools on the same GGUF, parsed to numbers.

Build them with `../shared/peers/llama-cpp.sh` (prints the folder that holds the binaries) and
pass that folder as `--llama-cpp-bin`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import Any


def _binary(bin_dir: str, name: str) -> str:
    path = os.path.join(os.path.expanduser(bin_dir), name)
    if not os.access(path, os.X_OK):
        raise ValueError(f"{path} is not an executable (build it with ../shared/peers/"
                         "llama-cpp.sh and pass the folder it prints)")
    return path


def _run(cmd: list[str], timeout_s: float) -> tuple[str, float]:
    """(stdout, this child's own peak RSS in MB, from wait4); stderr (its logs) is dropped."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{os.path.basename(cmd[0])} ran past {timeout_s:.0f}s")
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({proc.returncode}): "
                               f"{err.read()[-500:].decode(errors='replace')}")
        return out.read().decode(), usage.ru_maxrss / 1024


# A CPU build's weight repacking for AMX died on an illegal instruction in its AMX matmul on
# an Intel Xeon VM here (SIGILL, then SIGSEGV in ggml_backend_amx_mul_mat: the VM's AMX tiles
# are not usable): where the default run dies of a signal, the run is repeated with
# repacking off (its other kernels), and the result says so.
CRASH_CODES = (-4, -11, 132, 139)


def _run_or_without_repack(cmd: list[str], no_repack: list[str], timeout_s: float
                           ) -> tuple[str, float, bool]:
    """(stdout, peak RSS MB, whether repacking stayed on)."""
    try:
        out, rss_mb = _run(cmd, timeout_s)
        return out, rss_mb, True
    except RuntimeError as exc:
        if not any(f"failed ({code})" in str(exc) for code in CRASH_CODES):
            raise
    out, rss_mb = _run(cmd + no_repack, timeout_s)
    return out, rss_mb, False


def llama_bench(bin_dir: str, model: str, threads: int, n_prompt: int, n_gen: int,
                repetitions: int = 3, timeout_s: float = 900) -> dict[str, Any]:
    """`llama-bench` prefill (pp) and decode (tg) tokens/s, as its users run it (with its
    weight repacking off where that crashes on this CPU: `repack` in the result)."""
    cmd = [_binary(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(repetitions), "-o", "json"]
    t0 = time.perf_counter()
    out, rss_mb, repack = _run_or_without_repack(cmd, ["--repack", "0"], timeout_s)
    rows = json.loads(out)
    result: dict[str, Any] = {"rss_mb": rss_mb, "wall_s": time.perf_counter() - t0,
                              "repack": repack}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            result["prefill_tok_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            result["b1_tok_s"] = float(row["avg_ts"])
    return result


def llama_bench_depths(bin_dir: str, model: str, threads: int, depths: list[int], n_gen: int,
                       repetitions: int = 2, timeout_s: float = 900) -> dict[str, float]:
    """`llama-bench -d`: batch-1 decode tokens/s after a context of each depth, as
    {"d<depth>_tok_s": ...}."""
    cmd = [_binary(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-p", "0",
           "-n", str(n_gen), "-d", ",".join(map(str, depths)), "-r", str(repetitions),
           "-o", "json"]
    out, _, _ = _run_or_without_repack(cmd, ["--repack", "0"], timeout_s)
    return {f"d{row['n_depth']}_tok_s": float(row["avg_ts"]) for row in json.loads(out)
            if row.get("n_gen", 0) > 0}


def llama_batched_bench(bin_dir: str, model: str, threads: int, batch_sizes: list[int],
                        n_prompt: int, n_gen: int, timeout_s: float = 1800) -> dict[int, float]:
    """`llama-batched-bench` decode tokens/s (S_TG) per number of parallel sequences."""
    ctx = max(batch_sizes) * (n_prompt + n_gen) + 256
    cmd = [_binary(bin_dir, "llama-batched-bench"), "-m", model, "-t", str(threads),
           "-c", str(ctx), "-npp", str(n_prompt), "-ntg", str(n_gen),
           "-npl", ",".join(map(str, batch_sizes)), "--output-format", "jsonl"]
    out, _, _ = _run_or_without_repack(cmd, ["--no-repack"], timeout_s)
    speeds = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "pl" in row and "speed_tg" in row:
            speeds[int(row["pl"])] = float(row["speed_tg"])
    return speeds
