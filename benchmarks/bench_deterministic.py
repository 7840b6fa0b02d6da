"""What `--enable-deterministic-inference` costs: prefill, batch-1 and batch-32 decode with it
off and on, each in a fresh process, alternating, on the default model (or --model-path).

    nice -n -15 python -m benchmarks.bench_deterministic --rounds 2

The switch runs every batch of a quantized model on the native per-row path, prefill chunks
included (models/llama.py `_native_rows`); off, a decode batch of up to 64 rows already does,
and on the x16 / GGUF kernels a row's linears give the same bits at every row count. So the
figures say where invariance by default would cost. Each figure is the median of 3 timings
inside its process; the prompt of the prefill figure is ~1k tokens, the decode prompts short
and distinct (no cached prefix), the prefill time of a one-token run subtracted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing "
         "matches").split()
FIGURES = ("prefill_tok_s", "b1_tok_s", "b32_tok_s")


def _prompt(i: int, words: int) -> str:
    return f"Doc {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))


def worker(deterministic: bool, model_path: str | None) -> dict[str, Any]:
    from sglang_like.engine import Engine

    engine = Engine(model_path=model_path, log_level="warning", engine_in_process=True,
                    enable_deterministic_inference=deterministic, max_total_tokens=40000)
    params = {"temperature": 0, "ignore_eos": True}

    def timed(prompts: list[str], new_tokens: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(prompts, {**params, "max_new_tokens": new_tokens})
        return time.perf_counter() - t0

    try:
        timed([_prompt(0, 50)], 4)  # warm-up
        long_prompt = _prompt(1, 900)
        prompt_tokens = len(engine.tokenizer.encode(long_prompt))
        figures: dict[str, list[float]] = {f: [] for f in FIGURES}
        for _ in range(3):
            figures["prefill_tok_s"].append(prompt_tokens / timed([long_prompt], 1))
            one = timed([_prompt(2, 20)], 1)
            figures["b1_tok_s"].append(128 / (timed([_prompt(2, 20)], 129) - one))
            batch = [_prompt(10 + i, 20) for i in range(32)]
            one = timed(batch, 1)
            figures["b32_tok_s"].append(32 * 64 / (timed(batch, 65) - one))
        out = {f: statistics.median(v) for f, v in figures.items()}
        out["prompt_tokens"] = prompt_tokens
        return out
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_deterministic",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="off/on process pairs, alternating")
    ap.add_argument("--worker", choices=("off", "on"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker == "on", args.model_path)))
        return
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            cmd = [sys.executable, "-m", "benchmarks.bench_deterministic", "--worker", mode]
            if args.model_path:
                cmd += ["--model-path", args.model_path]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: " + ", ".join(
                f"{f} {rows[mode][-1][f]:.1f}" for f in FIGURES), file=sys.stderr, flush=True)
    print(f"\n--enable-deterministic-inference, {args.rounds} rounds (median of each figure), "
          f"prompt of {rows['off'][0]['prompt_tokens']} tokens for prefill")
    print(f"{'figure':<16}{'off':>10}{'on':>10}{'on / off':>10}")
    for f in FIGURES:
        off = statistics.median(r[f] for r in rows["off"])
        on = statistics.median(r[f] for r in rows["on"])
        print(f"{f:<16}{off:>10.1f}{on:>10.1f}{on / off:>9.2f}x")


if __name__ == "__main__":
    main()
