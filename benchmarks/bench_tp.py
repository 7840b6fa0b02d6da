"""Tensor parallelism's cost and gain on this machine: TP=1 beside TP=2, one run.

    python -m benchmarks.bench_tp [--quantization auto] [--rounds 5]

Both engines are loaded at once and measured in interleaved rounds (machines here drift more
than the differences): batch-1 decode ms/token (64 tokens less a prefill-only run) and one
~1,000-token prompt's prefill time; medians printed. On 2 cores TP=2 gives each rank one
core: it shows what the split costs (broadcast, all-reduces) rather than a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from benchmarks.common import decode_tok_s
from sglang_like.engine import Engine


def _decode_ms(engine: Engine) -> float:
    return 1000 / decode_tok_s(engine, 1, 64)


def _prefill_ms(engine: Engine, tag: str) -> tuple[float, int]:
    prompt = f"Run {tag}. " + " ".join(f"Fact {j}: {j} squared is {j * j}." for j in range(65))
    t0 = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": 1})
    return (time.perf_counter() - t0) * 1000, out["meta_info"]["prompt_tokens"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    engines = {tp: Engine(tp_size=tp, quantization=args.quantization, max_total_tokens=8192,
                          log_level="warning") for tp in args.tp_sizes}
    try:
        for e in engines.values():
            _decode_ms(e)  # warm-up
        dec: dict[int, list[float]] = {tp: [] for tp in engines}
        pre: dict[int, list[float]] = {tp: [] for tp in engines}
        num_tokens = 0
        for r in tqdm(range(args.rounds), desc="rounds"):
            for tp, e in engines.items():
                dec[tp].append(_decode_ms(e))
                ms, num_tokens = _prefill_ms(e, f"{r}-{tp}")
                pre[tp].append(ms)
    finally:
        for e in engines.values():
            e.shutdown()
    base = statistics.median(dec[args.tp_sizes[0]])
    print(f"\nquantization {args.quantization}, medians of {args.rounds} interleaved rounds")
    print(f"{'tp_size':>7} | {'decode ms/token':>15} | {'vs first':>8} | "
          f"{f'prefill {num_tokens} tok (ms)':>22}")
    for tp in engines:
        d = statistics.median(dec[tp])
        print(f"{tp:>7} | {d:>15.1f} | {d / base:>7.2f}x | {statistics.median(pre[tp]):>22.0f}")


if __name__ == "__main__":
    main()
