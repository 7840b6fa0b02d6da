"""Which int4 linear and LM-head kernel is faster at each row count, on this CPU.

On an AMX CPU `auto` picks the tile kernels by ISA; this measures, per row count, what each
kernel costs, the table a choice by speed would read. Prints the median microseconds of the
default model's four linears (summed) and of its LM head under each kernel (x16; AMX's tiles
where the CPU has them); writes bench_results/kernel_choice.json.

    python -m benchmarks.bench_kernel_choice [--rows 1,2,4,8,16,32,64,128] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR
from sglang_like.layers.quantization import Int4Method, Q4X16Method, Q8HeadMethod, QuantLinear
from sglang_like_kernels import cpu as native_cpu
from sglang_like_kernels.cpu import amx

# the default model's linears (in, out): qkv, o, gate_up, down; its head 576 -> 49152
LINEARS = ((576, 960), (576, 576), (576, 3072), (1536, 576))
HEAD = (576, 49152)


def _linear(method, k: int, n: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(k * 7 + n)
    lin = QuantLinear(method, k, [n], ["w"])
    w = torch.randn(n, k, generator=gen) / k**0.5
    lin.load_weights({"w.weight": w}, "", torch.device("cpu"))
    return lin


def _median_us(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernel_choice",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "kernel_choice.json"))
    args = ap.parse_args()
    if not native_cpu.available():
        raise SystemExit("the native CPU kernels are not built on this machine")
    rows = [int(r) for r in args.rows.split(",")]
    linears = {"x16": [_linear(Q4X16Method(), k, n) for k, n in LINEARS]}
    heads = {}
    for use_amx in (False, True):
        head = _linear(Q8HeadMethod(use_amx=use_amx), *HEAD)
        heads.setdefault("x16" if head.x16 else "amx" if head.amx else "float", head)
    if amx.available():
        linears["amx"] = [_linear(Int4Method(64), k, n) for k, n in LINEARS]
        assert all(lin.amx for lin in linears["amx"])
    results = []
    for t in tqdm(rows, desc="row counts"):
        row = {"rows": t}
        for name, lins in linears.items():
            row[f"linears_{name}_us"] = sum(
                _median_us(lin, torch.randn(t, lin.in_features), args.repeats) for lin in lins)
        for name, lin in heads.items():
            row[f"head_{name}_us"] = _median_us(lin, torch.randn(t, HEAD[0]), args.repeats)
        results.append(row)
    keys = [k for k in results[0] if k != "rows"]
    print(f"ISA {native_cpu.isa()}, AMX {amx.available()}, threads {torch.get_num_threads()}; "
          "median microseconds per call (the 4 linears summed)")
    print("rows " + " ".join(f"{k:>18}" for k in keys))
    for row in results:
        print(f"{row['rows']:>4} " + " ".join(f"{row[k]:>18.1f}" for k in keys))
    with open(args.output_json, "w") as f:
        json.dump({"isa": native_cpu.isa(), "amx": amx.available(), "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
