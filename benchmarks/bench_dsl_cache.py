"""Radix cache on vs off for two frontend-DSL workloads: wall time and cache hit rate.

    python -m benchmarks.bench_dsl_cache [--num-inputs 64] [--max-tokens 8]

The workloads: a fork-heavy tree of thought (3 x 3 branches) and few-shot QA over
`--num-inputs` inputs with run_batch. In-process only: one engine per setting.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import frontend_dsl as sgl

FEW_SHOT = "".join(
    f"Q: What is the capital of {c}?\nA: {a}\n\n"
    for c, a in [("Italy", "Rome"), ("Japan", "Tokyo"), ("Canada", "Ottawa"),
                 ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago")]
)
COUNTRIES = ["France", "Germany", "Spain", "Egypt", "Brazil", "India", "China", "Mexico"]


@sgl.function
def few_shot(s: Any, country: str, max_tokens: int) -> None:
    s += FEW_SHOT + f"Q: What is the capital of {country}?\nA:"
    s += sgl.gen("answer", max_tokens=max_tokens, stop="\n", temperature=0)


@sgl.function
def tree_of_thought(s: Any, question: str, max_tokens: int) -> None:
    s += "Solve the problem step by step.\nProblem: " + question + "\n"
    plans = s.fork(3)
    for i, plan in enumerate(plans):
        plan += f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=max_tokens, stop="\n")
        steps = plan.fork(3)
        for j, step in enumerate(steps):
            step += f"\nStep {j + 1}:" + sgl.gen("step", max_tokens=max_tokens, stop="\n")
        steps.join()
    plans.join()


def _hit_rate(metas: list[dict[str, Any]]) -> float:
    cached = sum(m.get("cached_tokens", 0) for m in metas)
    total = sum(m["prompt_tokens"] for m in metas)
    return cached / max(total, 1)


def run(disable_radix_cache: bool, num_inputs: int, max_tokens: int) -> dict[str, Any]:
    backend = sgl.Runtime(disable_radix_cache=disable_radix_cache, max_total_tokens=32768)
    out = {}
    t0 = time.perf_counter()
    states = few_shot.run_batch(
        [{"country": COUNTRIES[i % len(COUNTRIES)] + " " * (i // len(COUNTRIES)),
          "max_tokens": max_tokens} for i in range(num_inputs)], backend=backend)
    out["few_shot_s"] = time.perf_counter() - t0
    out["few_shot_hit"] = _hit_rate([s.get_meta_info("answer") for s in states])
    t0 = time.perf_counter()
    state = tree_of_thought.run(question="A farmer has 17 sheep and buys 5 more. How many?",
                                max_tokens=max_tokens, backend=backend)
    out["tot_s"] = time.perf_counter() - t0
    metas = [m for m in state.get_meta_info("plan")]
    out["tot_hit"] = _hit_rate(metas)
    out["server_hit_rate"] = backend.get_server_info().get("cache_hit_rate")
    backend.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_dsl_cache",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--num-inputs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    for disabled in (False, True):
        r = run(disabled, args.num_inputs, args.max_tokens)
        print(f"radix cache {'off' if disabled else 'on '}: few-shot x{args.num_inputs} "
              f"{r['few_shot_s']:.1f}s (prompt cache hit {r['few_shot_hit']:.0%}), "
              f"tree of thought 3x3 {r['tot_s']:.1f}s (plan hit {r['tot_hit']:.0%}), "
              f"engine cache_hit_rate {r['server_hit_rate']}")


if __name__ == "__main__":
    main()
