"""Decode beside a busy process: what another process taking a core costs each side, and what
`--decode-threads auto` gives back (sglang_like.utils.decode_threads).

    nice -n -15 python -m benchmarks.bench_contention \\
        --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin

For the default model, each setting in an engine of its own: batch-1 and batch-32 decode
tokens/s (`common.decode_tok_s`: a full run less its prefill), quiet, then with `--busy`
(1) processes spinning beside it (`python -c "while True: pass"`, placed by the OS), then
quiet again. Settings: `--decode-threads` at the machine's thread count (what every engine
did before `auto`), `auto`, and 1. Before each measurement with the busy processes, one
unmeasured run lets `auto` see them (it looks twice a second). llama.cpp's `llama-bench`
(batch 1, its defaults, as many threads as ours) runs quiet and busy on the same GGUF.
`--rounds N` keeps each figure's best of N. Writes bench_results/contention.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, decode_tok_s, llama_bench

SPIN = [sys.executable, "-c", "while True: pass"]


class Busy:
    """`n` spinning processes while inside the `with`."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> Busy:
        self.procs = [subprocess.Popen(SPIN) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _ours(spec: str, busy: int, rounds: int, new_tokens: int) -> dict[str, Any]:
    from sglang_like.engine import Engine

    engine = Engine(decode_threads=spec)
    try:
        decode_tok_s(engine, 1, 8)  # warm
        out: dict[str, Any] = {}
        for phase in ("quiet", "busy", "quiet_after"):
            with Busy(busy if phase == "busy" else 0):
                decode_tok_s(engine, 1, new_tokens)  # lets `auto` see the machine as it is now
                out[f"{phase}_b1"] = max(decode_tok_s(engine, 1, new_tokens)
                                         for _ in range(rounds))
                out[f"{phase}_b32"] = max(decode_tok_s(engine, 32, 32) for _ in range(rounds))
                out[f"{phase}_threads"] = engine.get_server_info()["cpu_threads"]
        return out
    finally:
        engine.shutdown()


def _peer(bin_dir: str, model: str, threads: int, busy: int, new_tokens: int
          ) -> dict[str, Any]:
    out = {}
    for phase in ("quiet", "busy"):
        with Busy(busy if phase == "busy" else 0):
            r = llama_bench(bin_dir, model, threads, n_prompt=16, n_gen=new_tokens,
                            repetitions=3)
        out[f"{phase}_b1"] = r["b1_tok_s"]
        out[f"{phase}_path"] = r["paths"]["b1_tok_s"]
    return out


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, batch in zip(axes, ("b1", "b32"), strict=True):
        quiet = [results[n].get(f"quiet_{batch}", 0) for n in names]
        busy = [results[n].get(f"busy_{batch}", 0) for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], quiet, 0.4, label="quiet")
        ax.bar([x + 0.2 for x in xs], busy, 0.4, label="a busy process beside it")
        ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch[1:]}")
        ax.legend(fontsize=8)
    fig.suptitle("Decode with another process taking a core")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"))
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "contention.json"))
    args = ap.parse_args(argv)

    import torch

    from sglang_like.model_loader import default_model_path

    threads = torch.get_num_threads()
    specs = [(f"ours, {threads} threads (before)", str(threads)), ("ours, auto", "auto"),
             ("ours, 1 thread", "1")]
    results: dict[str, Any] = {}
    for name, spec in tqdm(specs, desc="settings"):
        results[name] = _ours(spec, args.busy, args.rounds, args.new_tokens)
    if args.llama_cpp_bin:
        results[f"llama.cpp, {threads} threads"] = _peer(
            args.llama_cpp_bin, default_model_path(), threads, args.busy, args.new_tokens)

    print(f"\n{args.busy} busy process(es) beside a {threads}-thread engine, default model, "
          f"decode tokens/s (best of {args.rounds})\n")
    print("| setting | b1 quiet | b1 busy | busy / quiet | b32 quiet | b32 busy | busy / quiet "
          "| decode threads busy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b32 = (f"{r['quiet_b32']:.0f} | {r['busy_b32']:.0f} | "
               f"{r['busy_b32'] / r['quiet_b32']:.2f}x" if "quiet_b32" in r else "- | - | -")
        t = r.get("busy_threads")
        print(f"| {name} | {r['quiet_b1']:.0f} | {r['busy_b1']:.0f} | "
              f"{r['busy_b1'] / r['quiet_b1']:.2f}x | {b32} | "
              f"{t['decode'] if t else r.get('busy_path', '-')} |")
    base = results[specs[0][0]]
    auto = results["ours, auto"]
    print(f"\nauto over the fixed {threads} threads, busy: batch 1 "
          f"{auto['busy_b1'] / base['busy_b1']:.2f}x, batch 32 "
          f"{auto['busy_b32'] / base['busy_b32']:.2f}x; quiet: "
          f"{auto['quiet_b1'] / base['quiet_b1']:.2f}x, "
          f"{auto['quiet_b32'] / base['quiet_b32']:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"threads": threads, "busy": args.busy, "rounds": args.rounds,
                   "time": time.strftime("%Y-%m-%d %H:%M"), "results": results}, f, indent=1)
    _plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
