"""CPU decode attention over a radix-shared prefix: cascade path vs the plain path.

    python -m benchmarks.bench_cpu_attention [--batch 64] [--prefix 1000] [--suffix 130]

The shape is the bench_offline workload: `batch` requests whose KV rows begin with the same
`prefix` slots (a radix hit), each with its own `suffix` tokens. Times one layer of decode
attention both ways in the same run (the plain path is what the reference runs when no rows
share a prefix), and one layer of extend attention (each request extends `extend` new
tokens) for scale: extend has no cascade path, since a CPU test of one (scores for every new
token materialized) was no faster than per-request SDPA.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from benchmarks.common import best_of_s
from sglang_like_kernels import reference


def _best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` calls after one to warm up, in ms."""
    fn()
    return 1000 * best_of_s(fn, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_cpu_attention", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--suffix", type=int, default=130)
    ap.add_argument("--extend", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    b, p, s, e = args.batch, args.prefix, args.suffix, args.extend
    hq, hkv, d = 9, 3, 64  # SmolLM2-135M
    gen = torch.Generator().manual_seed(0)
    num_slots = p + b * (s + e) + 1
    k_pool = torch.randn(num_slots, hkv, d, generator=gen)
    v_pool = torch.randn(num_slots, hkv, d, generator=gen)
    table = torch.zeros(b, p + s + e, dtype=torch.int32)
    table[:, :p] = torch.arange(1, p + 1, dtype=torch.int32)
    own = torch.arange(p + 1, num_slots, dtype=torch.int32).view(b, s + e)
    table[:, p:] = own
    rows = torch.arange(b)
    scale = d**-0.5
    q_dec = torch.randn(b, hq, d, generator=gen)
    seq_lens = torch.full((b,), p + s)
    q_ext = torch.randn(b * e, hq, d, generator=gen)
    prefix_lens, extend_lens = torch.full((b,), p + s), torch.full((b,), e)

    def decode() -> None:
        # time a whole call, plan included (the model builds it once per forward, 30 layers)
        reference._plan_memo.__dict__.clear()
        reference.decode_attention(q_dec, k_pool, v_pool, table, rows, seq_lens, scale)

    def extend() -> None:
        reference.extend_attention(q_ext, k_pool, v_pool, table, rows, prefix_lens,
                                   extend_lens, scale)

    results = {}
    for name, patch in (("cascade", None), ("plain", lambda *a: [])):
        ctx = mock.patch.object(reference, "_shared_prefix_groups", patch) if patch else None
        if ctx:
            ctx.start()
        results[name] = (_best_ms(decode, args.repeats), _best_ms(extend, args.repeats))
        if ctx:
            ctx.stop()
    print(f"threads={torch.get_num_threads()} batch={b} shared prefix={p} own={s} "
          f"extend={e}  (one layer, best of {args.repeats})")
    print(f"{'path':<10}{'decode ms':>12}{'extend ms':>12}")
    for name, (dec, ext) in results.items():
        print(f"{name:<10}{dec:>12.1f}{ext:>12.1f}")
    c, pl = results["cascade"], results["plain"]
    print(f"{'speed-up':<10}{pl[0] / c[0]:>11.1f}x{'':>12}")


if __name__ == "__main__":
    main()
