"""Large decode batches on the native step against the torch layer path: where should
`native_decode.MAX_ROWS` stand?

    python -m benchmarks.bench_native_rows [--batches 64,128,256] [--rounds 2]

For each batch size, requests on one ~900-token cached prefix (the served shared-prefix
workload's prompts) and short distinct prompts, each run in a fresh in-process engine with
`MAX_ROWS` at the bound (native: the cascade reads the shared prefix once) and below the
batch (torch path: its own cascade); printed: decode tok/s of `--new-tokens` tokens a request,
every prompt cached first, the median of `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sglang_like import Engine
from sglang_like.bench_serving import make_workload
from sglang_like.layers import native_decode


def _prompts(n: int, shared: bool) -> list[str]:
    convs = make_workload("shared-prefix", n, 0, 600, 1)
    if shared:
        return [c.prefix + c.turns[0] for c in convs]
    return [f"{c.turns[0]} Number {i}." for i, c in enumerate(convs)]


def _decode_tok_s(prompts: list[str], max_rows: int, new_tokens: int, rounds: int) -> float:
    bound = native_decode.MAX_ROWS
    native_decode.MAX_ROWS = max_rows
    engine = Engine(engine_in_process=True, max_running_requests=len(prompts))
    try:
        params = {"temperature": 0, "ignore_eos": True}
        engine.generate(prompts, {**params, "max_new_tokens": 1})  # every prompt cached
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            engine.generate(prompts, {**params, "max_new_tokens": 1})
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.generate(prompts, {**params, "max_new_tokens": new_tokens + 1})
            rates.append(len(prompts) * new_tokens / (time.perf_counter() - t0 - prefill))
        return statistics.median(rates)
    finally:
        engine.shutdown()
        native_decode.MAX_ROWS = bound


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_native_rows",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    bound = native_decode.MAX_ROWS
    print(f"decode tok/s, {args.new_tokens} new tokens a request, median of {args.rounds} "
          f"rounds; native = MAX_ROWS {bound}, torch = the batch above MAX_ROWS")
    print(f"{'batch':>6}{'prompts':>10}{'torch':>9}{'native':>9}{'ratio':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        for shared in (True, False):
            prompts = _prompts(batch, shared)
            torch_path = _decode_tok_s(prompts, batch - 1, args.new_tokens, args.rounds)
            native = _decode_tok_s(prompts, max(bound, batch), args.new_tokens, args.rounds)
            print(f"{batch:>6}{'shared' if shared else 'short':>10}{torch_path:>9.0f}"
                  f"{native:>9.0f}{native / torch_path:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
