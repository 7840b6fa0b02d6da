"""Prefill on the native step against the torch layer path, in one engine, alternating.

    python -m benchmarks.bench_prefill_paths [--rounds 4] [--model-path FILE]

Which path an extend batch takes is `native_decode.extend_runs_natively`'s rule; this times
both on the same prompts (the engine's `native_decode` switched off for the torch rounds):
cold prompts (the cascade's causal blocks), and new requests on a cached system prompt. Each
case is one `generate` call of one new token (so one prefill forward; the cache flushed
first, and the system prompt cached again where the case wants it), the median of
`--rounds` rounds per path. Prints milliseconds, prompt tokens per second and the torch path
over the native; writes bench_results/prefill_paths.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR
from sglang_like import Engine
from sglang_like.bench_serving import make_workload
from sglang_like_kernels import cpu as native_cpu


def _cases(engine: Engine) -> dict[str, tuple[list[str], str | None]]:
    """name -> (prompts of one call, the prefix to cache before it or None)."""
    convs = make_workload("shared-prefix", 32, 0, 700, 1)
    system = convs[0].prefix
    served = [c.prefix + c.turns[0] for c in convs]
    tok = engine.tokenizer
    long = tok.decode(tok.encode(" ".join(served[:3]))[:2000])
    return {
        "cold, ~800 tokens": ([served[0]], None),
        "cold, 2,000 tokens": ([long], None),
        "32 cold prompts of ~30 tokens": ([s[-120:] + f" {i}" for i, s in enumerate(served)],
                                          None),
        "32 new on a cached ~800-token prompt": (served, system),
    }


def _time_ms(engine: Engine, prompts: list[str], prefix: str | None) -> float:
    params = {"temperature": 0, "max_new_tokens": 1}
    engine.flush_cache()
    if prefix is not None:
        engine.generate(prefix, params)
    t0 = time.perf_counter()
    engine.generate(prompts if len(prompts) > 1 else prompts[0], params)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill_paths",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "prefill_paths.json"))
    args = ap.parse_args(argv)
    kw: dict[str, Any] = {"model_path": args.model_path} if args.model_path else {}
    engine = Engine(engine_in_process=True, **kw)
    model = engine.runner.model
    rows = []
    try:
        cases = _cases(engine)
        for name, (prompts, prefix) in tqdm(cases.items(), desc="cases"):
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for native in (True, False):
                    model.native_decode = native
                    times[native].append(_time_ms(engine, prompts, prefix))
            model.native_decode = True
            cached = len(engine.tokenizer.encode(prefix)) if prefix else 0
            tokens = sum(len(engine.tokenizer.encode(p)) - cached for p in prompts)
            native_ms, torch_ms = (statistics.median(times[k]) for k in (True, False))
            rows.append({"case": name, "new_tokens": tokens, "native_ms": native_ms,
                         "torch_ms": torch_ms, "native_rounds": times[True],
                         "torch_rounds": times[False]})
    finally:
        engine.shutdown()
    print(f"\nprefill, one forward per case ({native_cpu.isa()} kernels, "
          f"{os.cpu_count()} cores), median of {args.rounds} rounds")
    print(f"{'case':38} {'new tokens':>10} {'native ms':>10} {'torch ms':>9} "
          f"{'native tok/s':>12} {'torch/native':>12}")
    for r in rows:
        print(f"{r['case']:38} {r['new_tokens']:>10} {r['native_ms']:>10.0f} "
              f"{r['torch_ms']:>9.0f} {r['new_tokens'] / r['native_ms'] * 1e3:>12.0f} "
              f"{r['torch_ms'] / r['native_ms']:>11.2f}x")
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(),
                   "isa": native_cpu.isa(), "model_path": args.model_path,
                   "rounds": args.rounds, "results": rows}, f, indent=1)
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
