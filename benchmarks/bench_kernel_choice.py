"""Which int4 linear and LM-head kernel is faster at each row count, on this CPU: the table
`auto`'s choices by row count are read off (docs/cpu-kernels.md).

Prints the median microseconds of the default model's four linears (summed) and of its LM
head under each kernel this CPU has, and writes bench_results/kernel_choice.json:

- linears: `x16` (q4_rows.c), `x16_tiles` (amx_kq.c: the same bytes and bits on AMX
  tiles), `x16_dense` (the x16 weights dequantized for a GEMM: the prefill path off AMX; from
  64 rows), `amx_pack` (torch's int4 pack on this project's tile kernels: codes below 256
  rows, bf16 from there; what `auto` ran on AMX before);
- head: `x16` (q8_rows.c), `x16_tiles` (amx_q8x16.c, the same bits), `x16_argmax` (greedy
  rows: `q8_x16_argmax`), `amx_rows` (row-major rows on amx_q8.c's kernels, the AMX head
  before);
- `auto_linear` / `auto_head`: what `auto` runs at that row count.

    python -m benchmarks.bench_kernel_choice [--rows 1,2,4,8,16,32,64,128,256,1024]
        [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR
from sglang_like.layers.quantization import Int4Method, Q4X16Method, Q8HeadMethod, QuantLinear
from sglang_like.layers.quantization.base import dense_forward
from sglang_like.layers.quantization.q4_native import int8_blocks_rounded
from sglang_like_kernels import cpu as native_cpu
from sglang_like_kernels.cpu import amx

# the default model's linears (in, out): qkv, o, gate_up, down; its head 576 -> 49152
LINEARS = ((576, 960), (576, 576), (576, 3072), (1536, 576))
HEAD = (576, 49152)
DENSE_MIN_ROWS = 64  # the dequantizing path is timed from here (it is for prefill chunks)

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _linear(method, k: int, n: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(k * 7 + n)
    lin = QuantLinear(method, k, [n], ["w"])
    w = torch.randn(n, k, generator=gen) / k**0.5
    lin.load_weights({"w.weight": w}, "", torch.device("cpu"))
    return lin


def _median_us(fn: Kernel, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _linear_kernels() -> dict[str, list[tuple[Kernel, int]]]:
    """Per kernel name, (x -> y, in_features) for each of the four linears (x float32;
    `amx_pack` is timed on the bf16 activations its layers take)."""
    x16 = [_linear(Q4X16Method(), k, n) for k, n in LINEARS]
    out = {
        "x16": [(lambda x, lin=lin: native_cpu.q4_x16_matmul(x, lin.x16, lin.x16_shape[0]),
                 lin.in_features) for lin in x16],
        "x16_dense": [(lambda x, lin=lin: dense_forward(int8_blocks_rounded(x),
                                                        lin.method.dequantize(lin)),
                       lin.in_features) for lin in x16],
    }
    if amx.available():
        out["x16_tiles"] = [(lambda x, lin=lin: amx.q4_x16_matmul(x, lin.x16, lin.x16_shape[0]),
                             lin.in_features) for lin in x16]
        packs = [_linear(Int4Method(64), k, n) for k, n in LINEARS]
        assert all(lin.amx for lin in packs)
        out["amx_pack"] = [(lambda x, lin=lin: lin.method.apply(lin, x), lin.in_features)
                           for lin in packs]
    return out


def _head_kernels() -> dict[str, Kernel]:
    head = _linear(Q8HeadMethod(), *HEAD)
    if not head.x16:
        return {"float": lambda x: head.method.apply(head, x)}
    w, s = head.weight, head.block_scale
    out = {"x16": lambda x: native_cpu.q8_x16_matmul(x, w, s),
           "x16_argmax": lambda x: native_cpu.q8_x16_argmax(x, w, s, head.row_bounds)[0]}
    if head.x16_amx:
        out["x16_tiles"] = lambda x: amx.q8_x16_matmul(x, w, s)
        rows = _linear(Q8HeadMethod(row_major_amx=True), *HEAD)
        out["amx_rows"] = lambda x: rows.method.apply(rows, x)
    return out


def _auto_choices(rows: int) -> tuple[str, str]:
    """What `auto` runs at `rows` rows: (linear kernel, head kernel) as named above."""
    lin = Q4X16Method()
    if amx.available():
        linear = "x16_tiles" if rows >= lin.amx_min_rows else "x16"
    else:
        linear = "x16_dense" if rows >= lin.dense_min_rows else "x16"
    head = Q8HeadMethod()
    tiles = amx.available() and rows >= head.amx_min_rows
    return linear, "x16_tiles" if tiles else "x16"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernel_choice",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,1024")
    ap.add_argument("--head-max-rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "kernel_choice.json"))
    args = ap.parse_args()
    if not native_cpu.available():
        raise SystemExit("the native CPU kernels are not built on this machine")
    rows = [int(r) for r in args.rows.split(",")]
    linears, heads = _linear_kernels(), _head_kernels()
    results = []
    for t in tqdm(rows, desc="row counts"):
        row: dict[str, float | int | str] = {"rows": t}
        repeats = max(5, args.repeats * 16 // max(t, 16))  # large row counts: fewer calls
        for name, kernels in linears.items():
            if name == "x16_dense" and t < DENSE_MIN_ROWS:
                continue
            dtype = torch.bfloat16 if name == "amx_pack" else torch.float32
            row[f"linears_{name}_us"] = sum(
                _median_us(fn, torch.randn(t, k, dtype=dtype), repeats) for fn, k in kernels)
        if t <= args.head_max_rows:
            for name, fn in heads.items():
                row[f"head_{name}_us"] = _median_us(fn, torch.randn(t, HEAD[0]), repeats)
        row["auto_linear"], row["auto_head"] = _auto_choices(t)
        results.append(row)
    keys = sorted({k for r in results for k in r if k.endswith("_us")},
                  key=lambda k: (not k.startswith("linears"), k))
    print(f"ISA {native_cpu.isa()}, AMX {amx.available()}, threads {torch.get_num_threads()}; "
          "median microseconds per call (the 4 linears summed)")
    print("rows " + " ".join(f"{k.removesuffix('_us'):>20}" for k in keys)
          + "  auto: linears / head")
    for row in results:
        cells = " ".join(f"{row[k]:>20.1f}" if k in row else f"{'':>20}" for k in keys)
        print(f"{row['rows']:>4} {cells}  {row['auto_linear']} / {row['auto_head']}")
    with open(args.output_json, "w") as f:
        json.dump({"isa": native_cpu.isa(), "amx": amx.available(),
                   "threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
