"""What a token row more costs a decode step, against the step's average row.

    python -m benchmarks.bench_row_cost [--pairs 1:4,8:12,16:24,32:48] [--rounds 5]

The speculation controller prices a verify's extra rows by this (`_ROW_SHARE` in
sglang_like/speculative/step_costs.py): a tree pays only where its drafts are expected to
commit more tokens per row than a row costs as a share of the plain step's average row. For
each pair b:b2 the default model decodes batch b and then batch b2 (greedy, `--new-tokens`
each, an in-process engine), back to back, `--rounds` times: a row more is
(step(b2) - step(b)) / (b2 - b), its share that over step(b) / b. The steps of a pair run
seconds apart, so the machine's drift (10-40% over minutes here) mostly cancels in the
ratio; the table gives the median and the spread of the rounds.
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm

from benchmarks.common import decode_tok_s


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        a, b = (int(x) for x in item.split(":"))
        if not 0 < a < b:
            raise argparse.ArgumentTypeError(f"{item}: want b:b2 with 0 < b < b2")
        out.append((a, b))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_row_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=_pairs, default=_pairs("1:4,8:12,16:24,32:48"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args(argv)

    from sglang_like import Engine

    engine = Engine(engine_in_process=True, quantization=args.quantization)
    shares: dict[tuple[int, int], list[float]] = {p: [] for p in args.pairs}
    steps: dict[tuple[int, int], list[tuple[float, float]]] = {p: [] for p in args.pairs}
    try:
        engine.generate("Warm up.", {"max_new_tokens": 8})
        for _ in tqdm(range(args.rounds), unit="round"):
            for b, b2 in args.pairs:
                t1 = b / decode_tok_s(engine, b, args.new_tokens)
                t2 = b2 / decode_tok_s(engine, b2, args.new_tokens)
                steps[(b, b2)].append((t1, t2))
                shares[(b, b2)].append((t2 - t1) / (b2 - b) / (t1 / b))
    finally:
        engine.shutdown()
    print(f"\n{args.quantization}, {args.rounds} rounds, {args.new_tokens} new tokens a request")
    print(f"{'rows':>9} {'step ms':>9} {'+rows ms':>9} {'row more ms':>12} "
          f"{'share (median)':>15} {'rounds':>26}")
    for (b, b2), vals in shares.items():
        t1 = statistics.median(s for s, _ in steps[(b, b2)])
        t2 = statistics.median(s for _, s in steps[(b, b2)])
        spread = f"{min(vals):.2f} .. {max(vals):.2f}"
        print(f"{f'{b}->{b2}':>9} {1e3 * t1:>9.2f} {1e3 * t2:>9.2f} "
              f"{1e3 * (t2 - t1) / (b2 - b):>12.3f} {statistics.median(vals):>15.2f} "
              f"{spread:>26}")


if __name__ == "__main__":
    main()
