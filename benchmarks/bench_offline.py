"""Offline benchmark: every weight format of ours beside llama.cpp on the same GGUF, one run.

    python -m benchmarks.bench_offline --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin
    python -m benchmarks.bench_offline --formats int4 --skip-peer        # ours only, quick
    python -m benchmarks.bench_offline --shared-prefix                   # + 64 x 1000-token
                                                                          #   prefix vs HF

Each format runs in a fresh process (its RSS is its own): batch-1 decode, batch 8 and 32
decode, batch-1 decode after a 4,096-token context (`--depths`), a 1,024-token prefill;
`--rounds N` runs every format and llama.cpp N times, interleaved round by round, and
keeps each figure's median; a ratio to llama.cpp is the median of the rounds' own ratios
(this machine's speed moves 25-70% over minutes). The bandwidth floor is the weight bytes
one decode step reads over this machine's measured read bandwidth. llama.cpp runs
`llama-bench` (batch-1 decode, prefill, long contexts) and `llama-batched-bench` (batched
decode) with 2 threads, as its users run them, one run per figure: weight repacking on (its
default) wherever that runs, off only for the figures whose default run crashes (its AMX
matmul on some Xeon VMs); the table marks those '*' and names each figure's path (the JSON's
`peer.paths`). Build it with ../shared/peers/llama-cpp.sh, which prints the folder to pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.bench_shared_prefix import run_shared_prefix
from benchmarks.common import (
    RESULTS_DIR,
    decode_tok_s,
    llama_batched_bench,
    llama_bench,
    llama_bench_depths,
    stream_decode_seconds,
)

# name -> Engine kwargs (and "env": variables its worker process runs under)
FORMATS = {
    "fp32": {"quantization": "none"},
    "bf16": {"quantization": "none", "dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    # what a user gets without asking: int4 for Q4_0/Q4_1 files, each matrix in its own type
    # for other GGUFs (gguf), int8 for dense checkpoints
    "auto": {"quantization": "auto"},
    # int4 with the native CPU kernels off: torch's ops only (the path before kernels/cpu)
    "int4-torch-ops": {"quantization": "int4", "env": {"SGLANG_LIKE_CPU_KERNELS": "off"}},
    "int4-no-amx": {"quantization": "int4", "env": {"SGLANG_LIKE_AMX": "off"}},
    # int4 on torch's int4 kernel (bf16 activations) rather than this project's x16 kernel
    "int4-torch": {"quantization": "int4", "env": {"SGLANG_LIKE_INT4_KERNEL": "torch"}},
    # int4 with a native call per op rather than one per decode step (decode_step.c)
    "int4-per-op": {"quantization": "int4", "env": {"SGLANG_LIKE_FUSED_DECODE": "0"}},
    # int4 with the shipped EAGLE-3 head (the controller decides where it drafts)
    "int4-eagle3": {"quantization": "int4", "speculative_algorithm": "EAGLE3"},
    # what an AVX2-only machine runs: torch's AVX2 kernels, the AVX2 build of ours (which
    # then takes int4's matmuls, see sglang_like/layers/quantization/q4_native.py)
    "int4-avx2": {"quantization": "int4",
                  "env": {"ATEN_CPU_CAPABILITY": "avx2", "SGLANG_LIKE_CPU_KERNELS": "avx2"}},
}
DEFAULT_FORMATS = ("fp32", "bf16", "int8", "int4", "int4-torch-ops", "int4-avx2")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _filler_ids(engine: Any, num_tokens: int) -> list[int]:
    """`num_tokens` token ids of plain filler text (prefill and long-context runs)."""
    return engine.tokenizer.encode(" ".join(["the quick brown fox jumps"] * num_tokens))[
        :num_tokens]


def _depth_decode_tok_s(engine: Any, depth: int, new_tokens: int) -> float:
    """Batch-1 decode tokens/s after a `depth`-token context (llama-bench's `-d`): streamed,
    the tokens after the first over the time after the first (the prefill left out)."""
    ids = _filler_ids(engine, depth)
    engine.flush_cache()
    _, seconds = stream_decode_seconds(engine, {
        "max_new_tokens": new_tokens + 1, "temperature": 0, "ignore_eos": True}, input_ids=ids)
    return new_tokens / seconds


def _prefill_tok_s(engine: Any, num_tokens: int) -> float:
    ids = _filler_ids(engine, num_tokens)
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    return num_tokens / (time.perf_counter() - t0)


def _a_down_proj(model: Any) -> Any:
    """The first layer's down projection (its first expert's in a mixture of experts)."""
    mlp = model.model.layers[0].mlp
    return mlp.experts[0].down_proj if hasattr(mlp, "experts") else mlp.down_proj


def worker(fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One format, in this process: numbers as a dict (printed as JSON by --worker)."""
    from sglang_like.engine import Engine

    t0 = time.perf_counter()
    # the engine itself, on a thread of this process (it reads the model's byte counts too)
    kwargs = {k: v for k, v in FORMATS[fmt].items() if k != "env"}
    engine = Engine(model_path=args.model_path, max_total_tokens=16384, engine_in_process=True,
                    **kwargs)
    load_s = time.perf_counter() - t0
    engine.generate("Warm up.", {"max_new_tokens": 8})
    model = engine.runner.model
    import sglang_like_kernels.cpu

    out = {"format": fmt, "quantization": engine.server_args.quantization, "load_s": load_s,
           "linear": type(_a_down_proj(model).method).__name__,
           "native_decode": bool(model.native_decode), "native_isa": sglang_like_kernels.cpu.isa(),
           "weight_mb": model.weight_bytes() / 1e6, "decode_mb": model.decode_bytes() / 1e6}
    out["b1_tok_s"] = decode_tok_s(engine, 1, args.new_tokens)
    for batch in args.batch_sizes:
        out[f"b{batch}_tok_s"] = decode_tok_s(engine, batch, args.batch_new_tokens)
    out["prefill_tok_s"] = _prefill_tok_s(engine, args.prefill_tokens)
    engine.get_server_info()  # a round trip through the loop: it has gone idle (and trimmed)
    out["rss_mb"] = _rss_mb()  # before the long contexts: the weights' and a 1k prefill's
    for depth in args.depths:
        out[f"d{depth}_tok_s"] = _depth_decode_tok_s(engine, depth, args.depth_new_tokens)
    engine.shutdown()
    return out


def measure_bandwidth_gbs(num_bytes: int = 1 << 29) -> float:
    """Read bandwidth with torch's threads: the best of 5 sums over a buffer >> cache."""
    x = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of several runs of a format: each speed their median, the rest the first's
    (a peer's `paths`: each figure's paths over the rounds, joined where they differ).
    Formats measured one after another minutes apart inherit the machine's drift into their
    ratios; rounds that interleave them and keep medians do not."""
    row = dict(runs[0])
    for key in list(row):
        if key.endswith("_tok_s"):
            row[key] = sorted(r[key] for r in runs)[len(runs) // 2]
    if "paths" in row:
        row["paths"] = {key: " / ".join(dict.fromkeys(r["paths"][key] for r in runs))
                        for key in row["paths"]}
    row["rounds"] = len(runs)
    return row


def round_ratios(runs: list[dict[str, Any]], peer_runs: list[dict[str, Any]]
                 ) -> dict[str, float]:
    """Per speed, the median over the rounds of ours over the peer's in the same round."""
    out = {}
    for key in runs[0]:
        if key.endswith("_tok_s") and all(p.get(key) for p in peer_runs):
            out[key] = statistics.median(
                r[key] / p[key] for r, p in zip(runs, peer_runs, strict=True))
    return out


def _run_worker(fmt: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_offline", "--worker", fmt, *argv]
    env = {**os.environ, **FORMATS[fmt].get("env", {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{fmt} worker failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _peer(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.skip_peer or not args.llama_cpp_bin:
        return None
    from sglang_like.model_loader import default_model_path

    model = args.model_path or default_model_path()
    peer = llama_bench(args.llama_cpp_bin, model, torch.get_num_threads(), args.prefill_tokens,
                       args.new_tokens)
    figures = [llama_batched_bench(args.llama_cpp_bin, model, torch.get_num_threads(),
                                   list(args.batch_sizes), 32, args.batch_new_tokens)]
    if args.depths:
        figures.append(llama_bench_depths(args.llama_cpp_bin, model, torch.get_num_threads(),
                                          args.depths, args.depth_new_tokens))
    for more in figures:
        peer["paths"].update(more.pop("paths"))
        peer.update(more)
    peer["weight_mb"] = peer["decode_mb"] = os.path.getsize(model) / 1e6
    return peer


def print_table(rows: list[dict[str, Any]], peer: dict[str, Any] | None, gbs: float,
                batch_sizes: list[int], depths: list[int],
                ratios: dict[str, dict[str, float]] | None = None) -> None:
    """`ratios`: per format and speed, ours over the peer's (the rounds' median); without
    them, the ratio of the medians."""
    cols = ["b1_tok_s", *[f"b{b}_tok_s" for b in batch_sizes],
            *[f"d{d}_tok_s" for d in depths], "prefill_tok_s"]

    head = (f"{'format':<16}{'read/step MB':>13}{'RSS MB':>8}{'floor tok/s':>12}"
            + "".join(f"{_column_name(c):>11}" if c != "prefill_tok_s" else f"{'prefill':>10}"
                      for c in cols))
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"\ndecode and prefill in tokens/s; floor = read bandwidth {gbs:.1f} GB/s / weight "
          f"bytes one decode step reads; b1 @N: batch-1 decode after an N-token context; "
          f"threads={torch.get_num_threads()}, ISA {isa}")
    print(head)
    every = [*rows, *([{"format": "llama.cpp GGUF", **peer}] if peer else [])]
    for r in every:
        floor = gbs * 1e3 / r["decode_mb"]
        cells = "".join(_cell(r, c) for c in cols)
        print(f"{r['format']:<16}{r['decode_mb']:>13.0f}{r.get('rss_mb', float('nan')):>8.0f}"
              f"{floor:>12.1f}{cells}")
    if peer:
        print(peer_paths_note(peer.get("paths", {}), cols))
        rounds = peer.get("rounds", 1)
        print("\nratio to llama.cpp (ours / theirs" + (
            f"; the median of {rounds} rounds' own ratios):" if ratios and rounds > 1 else "):"))
        for r in rows:
            mine = (ratios or {}).get(r["format"]) or {
                c: r[c] / peer[c] for c in cols if c in peer and peer[c]}
            marks = {c: "*" if _off_default(peer.get("paths", {}).get(c)) else "" for c in cols}
            line = "  ".join(f"{c.removesuffix('_tok_s')} {mine[c]:.2f}x{marks[c]}"
                             for c in cols if c in mine)
            print(f"  {r['format']:<16}{line}")


def _column_name(c: str) -> str:
    """A speed's column head: batch 8, b1 @4096, prefill."""
    c = c.removesuffix("_tok_s")
    if c == "prefill":
        return c
    return f"b1 @{c[1:]}" if c.startswith("d") else c.replace("b", "batch ", 1)


def _cell(r: dict[str, Any], c: str) -> str:
    """A speed, right-aligned; a peer figure that did not come from llama.cpp's default
    path (weight repacking on) is marked '*' (`peer_paths_note` names its path)."""
    width = 10 if c == "prefill_tok_s" else 11
    mark = "*" if _off_default(r.get("paths", {}).get(c)) else ""
    return f"{r.get(c, float('nan')):.1f}{mark}".rjust(width)


def _off_default(path: str | None) -> bool:
    return path is not None and "repack" in path


def peer_paths_note(paths: dict[str, str], cols: list[str]) -> str:
    """Which llama.cpp path each of its figures came from: its default (weight repacking
    on) where that runs, else the run with repacking off (marked '*' in the table)."""
    default = [_column_name(c) for c in cols if c in paths and not _off_default(paths[c])]
    off = [f"{_column_name(c)} ({paths[c]})" for c in cols if _off_default(paths.get(c))]
    note = "llama.cpp paths: " + (", ".join(default) + " by default (weight repacking on)"
                                  if default else "none by default")
    if off:
        note += ("; * repacking off, its default run having crashed on this CPU (AMX): "
                 + ", ".join(off))
    return note


def draw_throughput(rows: list[dict[str, Any]], peer: dict[str, Any] | None,
                    batch_sizes: list[int], path: str) -> None:
    """Decode tokens/s against batch size, one line per format, llama.cpp dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [1, *batch_sizes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    every = [*rows, *([{"format": "llama.cpp", **peer}] if peer else [])]
    for r in every:
        speeds = [r.get(f"b{b}_tok_s", float("nan")) for b in sizes]
        style = "--" if r["format"] == "llama.cpp" else "-"
        ax.plot(sizes, speeds, style, marker="o", label=r["format"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("decode batch size (streams)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Default model, {torch.get_num_threads()} threads, "
                 f"{torch.backends.cpu.get_cpu_capability()}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"throughput chart: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_offline", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                    help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--new-tokens", type=int, default=128, help="batch-1 decode length")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[8, 32])
    ap.add_argument("--batch-new-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[4096], help="batch-1 decode after contexts of these many tokens "
                    "(llama-bench -d); '' for none")
    ap.add_argument("--depth-new-tokens", type=int, default=64)
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="folder with llama-bench and llama-batched-bench")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every format, interleaved (each figure their median)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="also the 64 x 1000-token shared-prefix batch (ours vs HF generate)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=os.path.join(RESULTS_DIR, "bench_offline_throughput.png"),
                    help="where to draw decode tokens/s by batch size ('' for none)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    passthrough = [f"--new-tokens={args.new_tokens}",
                   f"--batch-sizes={','.join(map(str, args.batch_sizes))}",
                   f"--batch-new-tokens={args.batch_new_tokens}",
                   f"--prefill-tokens={args.prefill_tokens}",
                   f"--depths={','.join(map(str, args.depths))}",
                   f"--depth-new-tokens={args.depth_new_tokens}"]
    if args.model_path:
        passthrough.append(f"--model-path={args.model_path}")
    formats = args.formats.split(",")
    for fmt in formats:
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    runs: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in formats}
    peer_runs: list[dict[str, Any]] = []
    # formats and the peer interleaved, round by round: the machine's drift lands in none, and
    # each ratio to the peer is the median of the rounds' own ratios
    for _ in range(args.rounds):
        for fmt in formats:
            runs[fmt].append(_run_worker(fmt, passthrough))
            print(f"{fmt}: {runs[fmt][-1]}", flush=True)
        peer_run = _peer(args)
        if peer_run:
            peer_runs.append(peer_run)
            print(f"llama.cpp: {peer_run}", flush=True)
    rows = [_median_row(runs[fmt]) for fmt in formats]
    peer = _median_row(peer_runs) if peer_runs else None
    ratios = ({fmt: round_ratios(runs[fmt], peer_runs) for fmt in formats}
              if peer_runs else None)
    gbs = measure_bandwidth_gbs()
    print_table(rows, peer, gbs, args.batch_sizes, args.depths, ratios)
    if args.plot:
        draw_throughput(rows, peer, args.batch_sizes, args.plot)
    shared = run_shared_prefix(args.model_path, skip_hf=args.skip_hf) if args.shared_prefix \
        else None
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "peer": peer, "bandwidth_gbs": gbs,
                       "shared_prefix": shared}, f, indent=2)


if __name__ == "__main__":
    main()
