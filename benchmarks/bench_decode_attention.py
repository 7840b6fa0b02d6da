"""The native CPU decode attention alone (kernels/.../cpu/attention.c), default model's shape.

    python -m benchmarks.bench_decode_attention [--keys 268,1024,4096] [--rows 1,3,6]

`rows` query rows of one request read the same `keys` cached keys (a bf16 pool, the default's,
or each of `--kv-dtypes`: int8 / fp8 codes with their scales, issue #51),
each then its own path of a few tree nodes, as a speculative verify does (1 row: a plain
decode). Times RoPE + K/V store + attention for 30 layers (one call per layer, as the per-op
path; the fused step runs the same phases), best and median of `--repeats`, and prints the
bytes of K/V a step reads over the best time. Compare two commits by running this script from
each checkout in turn, more than once: the machine moves 10-40% between runs here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang_like_kernels import kv_quant
from sglang_like_kernels.cpu import ops

HQ, HKV, D, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _pool(slots: int, dtype: torch.dtype, gen: torch.Generator):
    """(pool, scales or None) of random rows"""
    x = torch.randn(slots, HKV, D, generator=gen)
    if kv_quant.is_quantized(dtype):
        return kv_quant.quantize(x, dtype)
    return x.to(dtype), None


def step_ms(keys: int, rows: int, repeats: int, dtype: torch.dtype = torch.bfloat16
            ) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    slots = keys + rows + 1
    pools = [(_pool(slots, dtype, gen), _pool(slots, dtype, gen)) for _ in range(LAYERS)]
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen)
    cos, sin = torch.randn(slots, D, generator=gen), torch.randn(slots, D, generator=gen)
    nodes = torch.arange(keys, keys + rows)
    table = torch.zeros(rows, keys + rows, dtype=torch.int32)
    table[:, :keys] = torch.arange(keys, dtype=torch.int32)
    paths = [[0, *range(1, i + 1, 2), i] if i else [0] for i in range(rows)]  # a small tree
    paths = [sorted(set(p)) for p in paths]
    for i, path in enumerate(paths):
        table[i, keys:keys + len(path)] = nodes[path].int()
    seq_lens = torch.tensor([keys + len(p) for p in paths])
    positions = seq_lens - 1
    times = []
    for _ in range(repeats + 1):  # the first warms the caches and the library
        t0 = time.perf_counter()
        for (k, ks), (v, vs) in pools:
            ops.decode_attention_rope(qkv, HQ, HKV, D, cos, sin, positions, k, v, nodes, table,
                                      torch.arange(rows), seq_lens, D**-0.5, torch.float32,
                                      k_scale=ks, v_scale=vs)
        times.append(time.perf_counter() - t0)
    times = times[1:]
    return min(times) * 1e3, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_decode_attention",
        description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="268,1024,4096")
    ap.add_argument("--rows", default="1,3,6")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-dtypes", default="bf16", help=f"comma-separated, of {list(DTYPES)}")
    args = ap.parse_args(argv)
    print(f"threads={torch.get_num_threads()} ISA {torch.backends.cpu.get_cpu_capability()}; "
          f"{LAYERS} layers of {HQ} query / {HKV} KV heads x {D}")
    print(f"{'pool':>9}{'keys':>6}{'rows':>6}{'best ms':>10}{'median ms':>11}{'KV MB':>8}"
          f"{'GB/s':>7}")
    for keys in map(int, args.keys.split(",")):
        for rows in map(int, args.rows.split(",")):
            for name in args.kv_dtypes.split(","):
                dtype = DTYPES[name]
                best, med = step_ms(keys, rows, args.repeats, dtype)
                per_row = D * dtype.itemsize + (4 if kv_quant.is_quantized(dtype) else 0)
                mb = keys * HKV * per_row * 2 * LAYERS / 1e6  # K and V, read once
                print(f"{name:>9}{keys:>6}{rows:>6}{best:>10.2f}{med:>11.2f}{mb:>8.0f}"
                      f"{mb / best:>7.1f}")


if __name__ == "__main__":
    main()
